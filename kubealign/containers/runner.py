"""`kubealign run --runner docker`: kfp.local's DockerRunner set up for the kubealign DAG.

- One image for every task: the CPU image stands in for the training image (kubernetes.train_image).
  It must be on the daemon (`make images`); an image built from other sources than this checkout is
  used with a warning.
- The whole OUTPUT is the pipeline root, so it is what kfp.local mounts (at the same path): artifacts,
  the default MLflow store (OUTPUT/mlflow.db, OUTPUT/mlartifacts) and the kfp.local cache all live in it.
  Inputs from elsewhere on the host (a local data file, a base model directory) are not visible in the
  containers and are refused up front.
- Tasks run as the image's non-root user (10001): OUTPUT is handed to that user when kubealign runs as
  root; otherwise the containers run as the invoking user (HOME=/tmp), so the files stay the user's.
- The host's network namespace (an MLflow server on 127.0.0.1 is reachable), 1 GiB of /dev/shm.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig
from kubealign.config.cache import CACHE_ENV
from kubealign.containers import daemon
from kubealign.errors import UserError

# What of this process's environment the tasks get (the subprocess runner passes all of it; a container
# gets nothing it is not given). KUBEALIGN_CACHE_DIR / KUBEALIGN_DOCKER_DIR are host paths: not passed.
PASSED_PREFIXES = ("MLFLOW_", "AWS_", "KUBEALIGN_", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TQDM_DISABLE")
HOST_ONLY = (CACHE_ENV, daemon.STATE_ENV)


def task_environment(env: dict[str, str | None]) -> dict[str, str]:
    """The environment of every container: this process's passed variables, then the run's own."""
    passed = {k: v for k, v in os.environ.items() if k.startswith(PASSED_PREFIXES) and k not in HOST_ONLY}
    passed.update({k: v for k, v in env.items() if v is not None})
    for key in [k for k, v in env.items() if v is None]:
        passed.pop(key, None)
    if os.environ.get("OMP_NUM_THREADS"):
        passed["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return passed


def host_paths(config: KubealignConfig, output: Path) -> list[str]:
    """Config values naming files or directories on this host outside OUTPUT (the containers see only
    OUTPUT)."""
    named = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(config.data.sources)]
    named += [(f"{stage}.model", getattr(config, stage).model) for stage in ("sft", "reward", "dpo")]
    outside = []
    for field, value in named:
        path = Path(value).expanduser()
        if path.exists() and not path.resolve().is_relative_to(output):
            outside.append(f"{field}={value}")
    return outside


def prepare(config: KubealignConfig, output: Path, env: dict[str, str | None]) -> tuple[KubealignConfig, Any, str]:
    """(the config the DAG is built from, the DockerRunner, the DOCKER_HOST kfp.local must use) for a run
    into OUTPUT (absolute, existing)."""
    from kfp import local

    from kubealign.containers.build import SOURCE_LABEL, repo_root, source_sha256

    outside = host_paths(config, output)
    if outside:
        raise UserError(
            f"--runner docker: the containers see only --output {output}, not {', '.join(outside)}; "
            "copy them under it or use --runner subprocess"
        )
    from kubealign.images import cpu_image

    image = config.kubernetes.cpu_image or cpu_image()
    client = daemon.client()  # a UserError saying how to start a daemon when none answers
    host = str(daemon.docker_host())
    try:
        import docker

        try:
            attrs = client.images.get(image).attrs
        except docker.errors.ImageNotFound:
            missing = f"--runner docker: image {image} is not on the Docker daemon: build it with `make images`"
            raise UserError(missing) from None
    finally:
        client.close()
    built_from = (attrs.get("Config", {}).get("Labels") or {}).get(SOURCE_LABEL)
    try:
        current = source_sha256(repo_root())
    except UserError:
        current = None  # an installed kubealign, no checkout: nothing to compare with
    if current and built_from != current:
        print(
            f"warning: {image} was built from other sources than this checkout; `make images` rebuilds it",
            file=sys.stderr,
        )
    user = attrs.get("Config", {}).get("User") or "0:0"
    environment = task_environment(env)
    # tiny models and tokenizers built by one task are reused by the next (the image's default is per container)
    environment[CACHE_ENV] = str(output / "cache")
    run_args: dict[str, Any] = {"network_mode": "host", "shm_size": "1g", "environment": environment}
    if os.geteuid() == 0:
        uid, _, gid = user.partition(":")
        hand_over(output, int(uid), int(gid or uid))
    else:
        run_args["user"] = f"{os.getuid()}:{os.getgid()}"
        run_args["environment"]["HOME"] = "/tmp"
    kubernetes = config.kubernetes.model_copy(update={"train_image": image, "cpu_image": image})
    return config.model_copy(update={"kubernetes": kubernetes}), local.DockerRunner(**run_args), host


def hand_over(output: Path, uid: int, gid: int) -> None:
    """Make OUTPUT (a new or earlier-run directory: check_run_output said so) the image user's."""
    for root, dirs, files in os.walk(output):
        os.chown(root, uid, gid)
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
