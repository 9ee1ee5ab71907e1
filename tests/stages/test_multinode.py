"""The multi-node TrainJob path rehearsed as two nodes on this machine (issue 81).

The ppo stage goes through kubealign.tasks.launch.ppo_trainjob, the code the KFP task runs when
kubernetes.ppo_nodes > 1: it stages its inputs on the PVC (a shared directory here), builds the TrainJob
(kubealign.cluster.trainjob.manifest) and waits for it. tests/support/local_trainer.py stands in for Kubeflow
Trainer: it checks the manifest against the v2.3 CRD schema and runs each node as the torch plugin would, the
manifest's command and env with PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR=127.0.0.1 / a free PET_MASTER_PORT,
each node in a directory of its own (its TMPDIR, HOME, caches). Nothing of the command is written again here.

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


def two_nodes(tmp_path: Path):
    return load_config(
        None,
        [
            *PPO,
            "kubernetes.ppo_nodes=2",
            "kubernetes.ppo_gpus=1",  # numProcPerNode 1: one rank per node (CPU here)
            "kubernetes.pvc=shared",
            f"kubernetes.pvc_mount={tmp_path / 'pvc'}",
            "kubernetes.train_image=local/kubealign-train:rehearsal",
            "kubernetes.trainjob_timeout_s=420",  # bounded: wait() deletes the TrainJob (its nodes stop) after it
        ],
    )


def one_node_two_ranks(trained, tmp_path: Path) -> dict:  # noqa: F811
    """The baseline: `torchrun --standalone --nproc_per_node 2` as a multi-GPU pod runs it (launch.torchrun_command)."""
    config = tmp_path / "one-node.yaml"
    config.write_text(config_to_yaml(load_config(None, PPO)), encoding="utf-8")
    out = tmp_path / "one-node"
    args = ["ppo", "--config", str(config), "--output", str(out)]
    args += ["--prompts", str(trained["split"]), "--actor", str(trained["sft"]), "--critic", str(trained["rm"])]
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV} | {"TQDM_DISABLE": "1"}
    done = launchers.run(launch.torchrun_command(2, args), timeout=420, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def rehearse(trained, tmp_path: Path, trainer: LocalTrainer) -> dict:  # noqa: F811
    out = tmp_path / "two-nodes"
    paths = [str(trained[k]) for k in ("split", "sft", "rm")]
    result = launch.ppo_trainjob(two_nodes(tmp_path), *paths, str(out), [], api=(trainer, None))
    assert json.loads((out / "result.json").read_text()) == result
    return result


def test_two_nodes_train_as_one_node_with_two_ranks(trained, tmp_path: Path):  # noqa: F811
    trainer = LocalTrainer(tmp_path / "nodes")
    two = rehearse(trained, tmp_path, trainer)
    assert trainer.attempts == [[0, 0]]
    assert "--checkpoints" in trainer.body["spec"]["trainer"]["command"]
    assert two["metrics"]["world_size"] == 2
    hashes = two["rank_param_sha256"]
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # ZeRO-3 across the nodes, gathered whole at the end
    one = one_node_two_ranks(trained, tmp_path)
    assert one["rank_param_sha256"] == hashes  # same seed: the same weights as one node with two ranks
    assert [h["reward_mean"] for h in two["history"]] == [h["reward_mean"] for h in one["history"]]
    # who writes what: every file a node wrote outside the PVC is its own launcher's log (no output, no
    # checkpoint, no MLflow file); on the PVC the staging (output included) was removed after the copy back
    for node in (0, 1):
        written = [p for p in (tmp_path / "nodes" / f"node{node}").rglob("*") if p.is_file()]
        assert [p.name for p in written] == ["try0.log"], written
    assert not any((tmp_path / "pvc" / "trainjobs").iterdir())
    node1 = trainer.output(1)
    assert "ppo:" not in node1 and "iteration" not in node1.lower(), node1[-2000:]  # rank 0 alone speaks


def kill_node1_after_a_checkpoint(trainer: LocalTrainer) -> None:
    """on_poll: node 1 lost (SIGKILL to its launcher and its rank) once the PVC holds a sealed iteration 2."""
    if len(trainer.attempts) > 0 or not trainer.nodes:
        return
    latest = list((trainer.root.parent / "pvc" / "trainjobs").glob("*/checkpoints/latest"))
    if latest and latest[0].read_text().strip() == "iter2" and trainer.nodes[1].poll() is None:
        trainer.kill_node(1)


def test_a_node_killed_mid_run_restarts_and_resumes_to_the_same_weights(trained, tmp_path: Path):  # noqa: F811
    trainer = LocalTrainer(tmp_path / "nodes", restarts=1, bound_s=BOUND_S, on_poll=kill_node1_after_a_checkpoint)
    resumed = rehearse(trained, tmp_path, trainer)
    assert len(trainer.attempts) == 2 and trainer.attempts[1] == [0, 0], trainer.attempts
    assert trainer.attempts[0][1] == -9 and trainer.attempts[0][0] != 0  # node 1 killed; node 0 failed with it
    # the survivor stopped by itself (its collective with the lost peer failed), within the bound: no hang
    assert trainer.stopped_after[0] is not None and trainer.stopped_after[0] < BOUND_S, trainer.stopped_after
    second = (tmp_path / "nodes" / "node0" / "try1.log").read_text()
    assert "ppo: resuming after iteration " in second, second[-2000:]  # not a fresh start
    straight = one_node_two_ranks(trained, tmp_path)
    assert resumed["rank_param_sha256"] == straight["rank_param_sha256"]  # as if never interrupted
    assert len(resumed["history"]) == 4
