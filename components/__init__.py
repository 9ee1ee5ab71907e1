"""KFP component declarations (installed as kubealign.components).

One lightweight Python component per stage: typed inputs/outputs (Dataset, Model, Metrics,
ClassificationMetrics, HTML, Markdown), the base image from kubealign.images, and a body that is one
call into kubealign.tasks (which runs the stage) plus the lines that hand its result to KFP's artifact
types (kubealign.tasks.artifacts). No packages_to_install and no pip install at start-up
(install_kfp_package=False): the images carry kubealign and kfp, and kfp.local's SubprocessRunner runs the
same bodies in this environment.
"""

from kubealign.components.stages import (
    act,
    compare,
    data_split,
    dpo,
    evaluate,
    feedback,
    judge,
    ppo,
    promote,
    promote_ranked,
    push,
    reward,
    serve,
    settle,
    sft,
    wait,
)

__all__ = [
    "act",
    "compare",
    "data_split",
    "dpo",
    "evaluate",
    "feedback",
    "judge",
    "ppo",
    "promote",
    "promote_ranked",
    "push",
    "reward",
    "serve",
    "settle",
    "sft",
    "wait",
]
