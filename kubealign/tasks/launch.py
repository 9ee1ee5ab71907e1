"""How a task launches its stage, and where a training task keeps its checkpoints.

Training stages run in-process on one device; in a pod with several GPUs they run under
`torchrun --standalone --nproc_per_node <GPUs>` (DeepSpeed picks the ranks up from torchrun's
environment); PPO with `kubernetes.ppo_nodes > 1` becomes a Kubeflow Trainer TrainJob
(kubealign.cluster.trainjob). On the cluster with a PVC a training task keeps its checkpoints under the
run and the task (checkpoint_location), so that a retried pod resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_to_yaml
from kubealign.errors import UserError
from kubealign.outputs import read_result
from kubealign.pod import CHECKPOINT_ROOT_ENV, FORWARDED_ENV, RUN_ID_ENV, TASK_ENV
from kubealign.ranks import RENDEZVOUS_ENV  # not training.distributed: that imports torch, a light task needs none


def device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(nproc: int, cli_args: list[str], nnodes_from_env: bool = False) -> list[str]:
    """`torchrun ... -m kubealign.cli ARGS`: standalone on one pod, or from PET_* env on a TrainJob node."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes_from_env:  # the Trainer's torch plugin sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR ...
        return [*launcher, "-m", "kubealign.cli", *cli_args]
    return [*launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", "kubealign.cli", *cli_args]


def run_distributed(config: KubealignConfig, nproc: int, cli_args: list[str], output: Path) -> dict[str, Any]:
    """Run `kubealign <cli_args> --config <resolved yaml>` on nproc local ranks and read its result."""
    with tempfile.TemporaryDirectory(prefix="kubealign-task-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(config_to_yaml(config), encoding="utf-8")
        command = torchrun_command(nproc, [*cli_args, "--config", str(config_file)])
        print("launching:", " ".join(command), flush=True)
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}  # a job of its own
        code = subprocess.run(command, check=False, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{cli_args[0]} on {nproc} ranks exited with code {code}")
    return read_result(output)


def checkpoint_location(environ: dict[str, str] | None = None) -> tuple[Path | None, bool]:
    """(where this task keeps its checkpoints, whether to resume from them).

    On the cluster with a PVC: ROOT/RUN/TASK (kubealign.pod.CHECKPOINT_ROOT_ENV, RUN_ID_ENV, TASK_ENV), so that
    a pod retried after a preemption, an eviction or a crash finds what its predecessor saved and resumes (a
    fresh task finds nothing there and starts). Anywhere else (kfp.local, no PVC, no run label): (None, False),
    the stage's default beside its output."""
    env = os.environ if environ is None else environ
    root, run, task = (env.get(key, "").strip() for key in (CHECKPOINT_ROOT_ENV, RUN_ID_ENV, TASK_ENV))
    if not (root and run and task):
        return None, False
    for label, value in (("run", run), ("task", task)):
        if "/" in value or value in (".", ".."):
            raise UserError(f"{RUN_ID_ENV if label == 'run' else TASK_ENV}={value!r} is not a directory name")
    location = Path(root) / run / task
    resume = location.is_dir() and any(location.iterdir())
    print(f"checkpoints: {location}" + (" (resuming from them)" if resume else ""), flush=True)
    return location, resume


def tidy(location: Path | None, result: dict[str, Any]) -> dict[str, Any]:
    """After a stage finished (it removed its own checkpoints): the run's directory on the PVC, once empty."""
    if location is not None:
        with contextlib.suppress(OSError):  # not empty: another task of the run still keeps checkpoints there
            location.parent.rmdir()
    return result


def checkpoint_args(location: Path | None, resume: bool) -> list[str]:
    """The CLI form of checkpoint_location's answer, for a torchrun or TrainJob process."""
    return ([] if location is None else ["--checkpoints", str(location)]) + (["--resume"] if resume else [])


def functions_file(specs: list, directory: Path) -> list[str]:
    """CLI args handing the embedded functions to a `kubealign ppo|evaluate` process (torchrun, a TrainJob)."""
    from kubealign.usercode import definitions

    if not specs:
        return []
    path = directory / "reward_functions.json"
    path.write_text(definitions.to_json(specs), encoding="utf-8")
    return ["--reward-functions", str(path)]


def ppo_trainjob(
    config: KubealignConfig,
    prompts: str,
    actor: str,
    critic: str,
    output: str,
    specs: list,
    location: Path | None = None,
    resume: bool = False,
    api: tuple[Any, Any] | None = None,
) -> dict:
    """Stage the inputs on the shared PVC, run PPO as a TrainJob, copy the actor back; the staging directory
    is removed on every exit this process lives through (a SIGKILLed try's is replaced by the retry's).

    The TrainJob's name comes from the run and task (checkpoint_location's keys) when the pod has them, so a
    retry finds and replaces its predecessor's TrainJob, and the new one resumes from LOCATION (the nodes get
    --resume whatever RESUME says: a JobSet restart reruns their command, see below). The MLflow
    settings in kubealign.pod.FORWARDED_ENV travel into the nodes' pods. api: (CustomObjectsApi, CoreV1Api),
    default the cluster's (trainjob.connect); tests/support/local_trainer.py runs the nodes on this machine."""
    from kubealign.cluster import trainjob
    from kubealign.images import train_image
    from kubealign.training import preemption

    k8s = config.kubernetes
    key = f"{os.environ[RUN_ID_ENV]}/{os.environ[TASK_ENV]}" if location is not None else f"{output}{os.getpid()}"
    name = f"kubealign-ppo-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    shared = Path(k8s.pvc_mount) / "trainjobs" / name
    custom, core = api or trainjob.connect()
    with preemption.raising("ppo"):
        try:
            trainjob.replace_leftover(custom, name, k8s.namespace, timeout_s=k8s.grace_period_s + 60)
            shutil.rmtree(shared, ignore_errors=True)  # the predecessor's staging (the name is this task's)
            for label, source in (("prompts", prompts), ("actor", actor), ("critic", critic)):
                shutil.copytree(source, shared / label)
            (shared / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
            cli_args = ["ppo", "--config", str(shared / "config.yaml"), "--output", str(shared / "output")]
            for label in ("prompts", "actor", "critic"):
                cli_args += [f"--{label}", str(shared / label)]
            # Always --resume, from checkpoints on the PVC: a node lost mid-run restarts the TrainJob's nodes
            # (JobSet) with this same command, which must go on from what they saved, not refuse the directory.
            # The location is this task's alone (emptied with the staging when there is no run/task to name it),
            # so --resume over an empty one is a fresh start.
            cli_args += functions_file(specs, shared) + checkpoint_args(location or shared / "checkpoints", True)
            env = {key: os.environ[key] for key in FORWARDED_ENV if key in os.environ}
            image = k8s.train_image or train_image()
            owners = trainjob.owner_references(dict(os.environ), k8s.namespace)
            body = trainjob.manifest(name, k8s, image, torchrun_command(0, cli_args, True), env, owners)
            trainjob.run(custom, core, body, k8s.trainjob_timeout_s)
            shutil.copytree(shared / "output", output, dirs_exist_ok=True)
        finally:
            shutil.rmtree(shared, ignore_errors=True)
    return read_result(Path(output))
