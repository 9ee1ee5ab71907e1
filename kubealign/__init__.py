"""kubealign: RLHF (SFT, reward model, PPO with DeepSpeed's Hybrid Engine, evaluation) as a Kubeflow
Pipelines DAG, tracked in MLflow. The library never imports kfp; see components/ and pipelines/."""

__version__ = "0.1.0"
