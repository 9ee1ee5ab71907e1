"""Kubeflow Trainer on this machine: a stand-in of the CustomObjectsApi that kubealign.cluster.trainjob drives, whose
TrainJobs run as the Trainer would run them, one torchrun launcher per node, on 127.0.0.1.

create: the TrainJob is checked against the Trainer v2.3 CRD schema, then each of its numNodes nodes starts
`spec.trainer.command` with `spec.trainer.env` (literal values; the optional secretKeyRefs have no Secret here)
and the PET_* variables the Trainer's torch plugin sets (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT: pkg/constants in kubeflow/trainer v2.3.0), each node in a working directory of
its own with its own TMPDIR, HOME and caches (what a pod has on its node's disk); the PVC is the config's
kubernetes.pvc_mount, shared by all. Nothing of the test's own rendezvous variables passes.

A node that exits non-zero (or is killed: `kill_node`) fails the JobSet: the other nodes get `bound_s` to stop on
their own (`stopped_after` records how long each took, or None when it had to be stopped), then, with restarts
left (JobSet failurePolicy.maxRestarts), every node starts again with the same command and env, as JobSet
recreates its jobs; without, the TrainJob is Failed. All nodes exit 0: Complete.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubealign.ranks import RENDEZVOUS_ENV
from tests.support import launchers
from tests.support.k8s_schemas import errors


class NotFound(Exception):
    """The API's 404 (kubernetes.client.ApiException has .status)."""

    status = 404


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_env(body: dict, node: int, port: int, workdir: Path) -> dict[str, str]:
    """What node NODE's container sees: this machine's environment less any rendezvous, the TrainJob's env, the
    torch plugin's PET_* and a disk of its own."""
    trainer = body["spec"]["trainer"]
    env = {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_ENV}
    env.update({e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e})
    env.update(
        PET_NNODES=str(trainer["numNodes"]),
        PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]),
        PET_NODE_RANK=str(node),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        TQDM_DISABLE="1",
    )
    for key, sub in (("TMPDIR", "tmp"), ("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("HF_HOME", "cache/hf")):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
        env[key] = str(workdir / sub)
    env["TORCH_EXTENSIONS_DIR"] = str(workdir / "cache" / "torch_extensions")  # compiled ops: per node
    env["TRITON_CACHE_DIR"] = str(workdir / "cache" / "triton")
    return env


class LocalTrainer:
    """CustomObjectsApi for TrainJobs (create / get / delete), run locally; `attempts` records each try's nodes'
    return codes, `stopped_after` how long the surviving nodes took to stop after a node failed."""

    def __init__(
        self, root: Path, restarts: int = 0, bound_s: float = 60.0, on_poll: Callable[[LocalTrainer], None] = None
    ):
        self.root, self.restarts, self.bound_s, self.on_poll = root, restarts, bound_s, on_poll
        self.body: dict[str, Any] | None = None
        self.nodes: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.attempts: list[list[int | None]] = []
        self.stopped_after: list[float | None] = []
        self.state: str | None = None
        self.message = ""
        self._lock = threading.Lock()

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, body: dict):
        assert (group, version, plural) == ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
        problems = errors(body)
        assert problems == [], problems  # what a strict API server with the v2.3 CRD would refuse
        self.body = body
        self._start()
        threading.Thread(target=self._watch, daemon=True).start()
        return body

    def _start(self) -> None:
        port, attempt = free_port(), len(self.attempts)
        self.nodes, self.logs = [], []
        for node in range(self.body["spec"]["trainer"]["numNodes"]):
            workdir = self.root / f"node{node}"  # the node's own disk, kept across restarts (same node)
            env = node_env(self.body, node, port, workdir)
            log = workdir / f"{self.body['metadata']['name']}-try{attempt}.log"
            with open(log, "w") as out:
                command = self.body["spec"]["trainer"]["command"]
                self.nodes.append(subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT))
            self.logs.append(log)

    def kill_node(self, node: int) -> None:
        """SIGKILL to every process of node NODE (its launcher and its ranks): the node is lost."""
        proc = self.nodes[node]
        for pid in [*launchers.children(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _watch(self) -> None:
        while self.state is None:
            if self.on_poll is not None:
                self.on_poll(self)
            codes = [proc.poll() for proc in self.nodes]
            if all(code == 0 for code in codes):
                self.attempts.append(codes)
                self._end("Complete", "all nodes exited 0")
            elif any(code not in (0, None) for code in codes):
                self._failed()
            time.sleep(0.2)

    def _failed(self) -> None:
        """A node failed: the others get bound_s to stop on their own, then the JobSet restarts or fails."""
        failed = time.monotonic()
        for proc in self.nodes:
            try:
                proc.wait(timeout=max(0.0, self.bound_s - (time.monotonic() - failed)))
                self.stopped_after.append(time.monotonic() - failed)
            except subprocess.TimeoutExpired:
                self.stopped_after.append(None)
                launchers.stop_tree(proc)
        self.attempts.append([proc.returncode for proc in self.nodes])
        if len(self.attempts) <= self.restarts:
            self._start()
        else:
            self._end("Failed", f"node exit codes {self.attempts[-1]}")

    def _end(self, state: str, message: str) -> None:
        self.state, self.message = state, message

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str):
        if self.body is None or self.body["metadata"]["name"] != name:
            raise NotFound(f"trainjobs {name} not found")
        deadline = time.monotonic() + 9.0  # a watch more than a poll: kubealign's wait() sleeps 10 s between gets
        while self.state is None and time.monotonic() < deadline:
            time.sleep(0.2)
        conditions = [] if self.state is None else [{"type": self.state, "status": "True", "message": self.message}]
        return {**(self.body or {}), "status": {"conditions": conditions}}

    def delete_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str):
        for proc in self.nodes:
            if proc.poll() is None:
                launchers.stop_tree(proc)
        self.state = self.state or "Deleted"

    def output(self, node: int = 0) -> str:
        """Everything node NODE's launcher and ranks printed for this TrainJob, every try."""
        tries = sorted((self.root / f"node{node}").glob(f"{self.body['metadata']['name']}-try*.log"))
        return "\n".join(log.read_text(errors="replace") for log in tries)
