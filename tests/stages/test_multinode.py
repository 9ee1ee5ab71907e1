"""The multi-node TrainJob path rehearsed as two nodes on this machine (issue 81).

The ppo stage goes through kubealign.tasks.launch.ppo_trainjob, the code the KFP task runs when
kubernetes.ppo_nodes > 1: it stages its inputs on the PVC (a shared directory here), builds the TrainJob
(kubealign.cluster.trainjob.manifest) and waits for it. tests/support/local_trainer.py stands in for Kubeflow
Trainer: it checks the manifest against the v2.3 CRD schema and runs each node as the torch plugin would, the
manifest's command and env with PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR=127.0.0.1 / a free PET_MASTER_PORT,
each node in a directory of its own (its TMPDIR, HOME, caches). Nothing of the command is written again here.

sft runs the same way from a TrainJob manifest of kubealign's (the KFP DAG hands only ppo to the Trainer today).

What it proves: torchrun's multi-node rendezvous from the PET_* variables, one rank per node at ZeRO-3, the
PVC as the only shared disk (rank 0 alone writes the output and the checkpoints there), the same weights as one
node with two ranks under the same seed, and a node lost mid-run: the survivor stops by itself within a bound,
the restarted nodes (JobSet's restart: the same command) resume from the PVC's checkpoints and end with an
uninterrupted run's weights. What it cannot: a real network between hosts, GPUs and NCCL, a real kubelet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kubealign.config import config_to_yaml, load_config
from kubealign.ranks import RENDEZVOUS_ENV
from kubealign.tasks import launch
from tests.conftest import NO_TRACKING
from tests.stages.test_ppo import trained  # noqa: F401 - the module fixture: split, SFT actor, reward model
from tests.support import launchers
from tests.support.local_trainer import LocalTrainer

pytestmark = pytest.mark.multinode

PPO = [
    NO_TRACKING,
    "ppo.actor_zero_stage=3",
    "ppo.critic_zero_stage=3",
    "ppo.num_iterations=4",
    "ppo.save_every_iterations=1",
]
BOUND_S = 60.0  # how long the surviving node may take to notice its peer is gone and exit


def two_nodes(tmp_path: Path, *extra: str):
    return load_config(
        None,
        [
            *PPO,
            *extra,
            "kubernetes.ppo_nodes=2",
            "kubernetes.ppo_gpus=1",  # numProcPerNode 1: one rank per node (CPU here)
            "kubernetes.pvc=shared",
            f"kubernetes.pvc_mount={tmp_path / 'pvc'}",
            "kubernetes.train_image=local/kubealign-train:rehearsal",
            "kubernetes.trainjob_timeout_s=420",  # bounded: wait() deletes the TrainJob (its nodes stop) after it
        ],
    )


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Path:
    """The nodes' own disks, kept from one TrainJob to the next as a cluster's nodes are (DeepSpeed's CPU comm op,
    compiled by each node into its own cache on first use, is compiled once per node)."""
    return tmp_path_factory.mktemp("nodes")


@pytest.fixture(scope="module")
def one_node(trained, tmp_path_factory) -> dict:  # noqa: F811
    """The baseline: one node with two ranks, `torchrun --standalone --nproc_per_node 2` as a multi-GPU pod runs
    the stage (launch.torchrun_command), uninterrupted."""
    tmp_path = tmp_path_factory.mktemp("one-node")
    config = tmp_path / "one-node.yaml"
    config.write_text(config_to_yaml(load_config(None, PPO)), encoding="utf-8")
    out = tmp_path / "one-node"
    args = ["ppo", "--config", str(config), "--output", str(out)]
    args += ["--prompts", str(trained["split"]), "--actor", str(trained["sft"]), "--critic", str(trained["rm"])]
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV} | {"TQDM_DISABLE": "1"}
    done = launchers.run(launch.torchrun_command(2, args), timeout=420, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def rehearse(trained, tmp_path: Path, trainer: LocalTrainer, *extra: str) -> dict:  # noqa: F811
    out = tmp_path / "two-nodes"
    paths = [str(trained[k]) for k in ("split", "sft", "rm")]
    result = launch.ppo_trainjob(two_nodes(tmp_path, *extra), *paths, str(out), [], api=(trainer, None))
    assert json.loads((out / "result.json").read_text()) == result
    return result


def test_two_nodes_train_as_one_node_with_two_ranks(trained, one_node, nodes: Path, tmp_path: Path):  # noqa: F811
    trainer = LocalTrainer(nodes)
    store = f"sqlite:///{tmp_path / 'pvc' / 'mlflow.db'}"  # MLflow's store on the PVC: any rank could reach it
    two = rehearse(trained, tmp_path, trainer, "tracking.enabled=true", f"tracking.uri={store}")
    assert trainer.attempts == [[0, 0]]
    assert "--checkpoints" in trainer.body["spec"]["trainer"]["command"]
    assert two["metrics"]["world_size"] == 2
    hashes = two["rank_param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # ZeRO-3 across the nodes, gathered whole at the end
    assert one_node["rank_param_sha256"] == hashes  # same seed: the same weights as one node with two ranks
    assert [h["reward_mean"] for h in two["history"]] == [h["reward_mean"] for h in one_node["history"]]
    # who writes what: on a node's own disk, its launcher's log and its caches (DeepSpeed's comm op, compiled
    # there); node 0 also MLflow's artifacts (a database URI without a server puts them under ./mlruns: on a
    # cluster the chart's server takes them); node 1 nothing else. The output and checkpoints: on the PVC only
    # (the staging, output and checkpoints included, removed after the copy back)
    for node, allowed in ((0, {"cache", "mlruns"}), (1, {"cache"})):
        root = nodes / f"node{node}"
        written = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
        assert all(p.suffix == ".log" for p in written if p.parts[0] not in allowed), written
        assert not any(p.name == "result.json" for p in written if p.parts[0] != "mlruns"), written
    assert not any((tmp_path / "pvc" / "trainjobs").iterdir())
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs  # one run: rank 0's, not one a rank
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "reward_mean")] == [1, 2, 3, 4]
    said = "ppo: ppo.rollout.engine"  # the stage's own lines: rank 0 alone speaks
    assert said in trainer.output(0) and said not in trainer.output(1)


def kill_node1_after_a_checkpoint(pvc: Path):
    """on_poll: node 1 lost (SIGKILL to its launcher and its rank) once the PVC holds a sealed iteration 2."""

    def poll(trainer: LocalTrainer) -> None:
        if trainer.attempts or not trainer.nodes or trainer.nodes[1].poll() is not None:
            return
        latest = list((pvc / "trainjobs").rglob("latest"))  # wherever the nodes keep their checkpoints
        if latest and latest[0].read_text().strip() == "iter2":
            trainer.kill_node(1)

    return poll


def test_a_node_killed_mid_run_restarts_and_resumes_to_the_same_weights(trained, one_node, nodes, tmp_path):  # noqa: F811
    trainer = LocalTrainer(nodes, restarts=1, bound_s=BOUND_S, on_poll=kill_node1_after_a_checkpoint(tmp_path / "pvc"))
    resumed = rehearse(trained, tmp_path, trainer)
    assert len(trainer.attempts) == 2 and trainer.attempts[1] == [0, 0], trainer.attempts
    assert trainer.attempts[0][1] == -9 and trainer.attempts[0][0] != 0  # node 1 killed; node 0 failed with it
    # the survivor stopped by itself (its collective with the lost peer failed), within the bound: no hang
    assert trainer.stopped_after[0] is not None and trainer.stopped_after[0] < BOUND_S, trainer.stopped_after
    print(f"multinode: the surviving node stopped {trainer.stopped_after[0]:.1f} s after node 1 was lost")
    second = trainer.logs[0].read_text()  # node 0's log of the restart
    assert "ppo: resuming after iteration " in second, second[-2000:]  # not a fresh start
    assert resumed["rank_param_sha256"] == one_node["rank_param_sha256"]  # as if never interrupted
    assert len(resumed["history"]) == 4


SFT = ["sft", "--set", NO_TRACKING, "--set", "sft.zero_stage=3", "--set", "sft.num_train_epochs=0.15"]


def test_sft_as_two_trainjob_nodes_equals_one_node_with_two_ranks(trained, nodes, tmp_path: Path):  # noqa: F811
    """sft run by the same stand-in: a TrainJob manifest of kubealign's (trainjob.manifest, the nodes' torchrun
    command from launch.torchrun_command) against `torchrun --standalone --nproc_per_node 2`."""
    from kubealign.cluster import trainjob

    args = [*SFT, "--data", str(trained["split"])]
    k8s = two_nodes(tmp_path).kubernetes
    command = launch.torchrun_command(0, [*args, "--output", str(tmp_path / "pvc" / "two")], nnodes_from_env=True)
    trainer = LocalTrainer(nodes)
    body = trainjob.manifest("kubealign-sft-rehearsal", k8s, k8s.train_image, command)
    trainer.create_namespaced_custom_object(trainjob.GROUP, trainjob.VERSION, k8s.namespace, trainjob.PLURAL, body)
    assert (
        trainjob.wait(trainer, body["metadata"]["name"], k8s.namespace, timeout_s=300, poll_s=0) == "all nodes exited 0"
    )
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV} | {"TQDM_DISABLE": "1"}
    one = launchers.run(launch.torchrun_command(2, [*args, "--output", str(tmp_path / "one")]), timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    two, one = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("pvc/two", "one"))
    assert two["metrics"]["world_size"] == 2 and two["rank_param_sha256"] == one["rank_param_sha256"]
