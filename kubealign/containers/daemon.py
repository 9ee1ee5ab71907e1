"""Which Docker daemon kubealign talks to, and a private one it can start.

Resolution order (docker_host): $DOCKER_HOST; else kubealign's private daemon if it is running; else
the system socket /var/run/docker.sock if it answers. The private daemon lives in state_dir()
($KUBEALIGN_DOCKER_DIR, default ~/.cache/kubealign-docker): socket, data root (images survive between
runs: that is the cache of base images and layers), exec root, pid file and log. It runs without
systemd and touches no host networking (--bridge=none, no iptables rules): builds run with no network
and local runs use the host's network namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from kubealign.errors import UserError

STATE_ENV = "KUBEALIGN_DOCKER_DIR"
SYSTEM_SOCKET = Path("/var/run/docker.sock")


def state_dir() -> Path:
    # Not under KUBEALIGN_CACHE_DIR: the test suite points that at a temp dir per session, and the images
    # this daemon holds are the cache worth keeping between runs on one machine.
    return Path(os.environ.get(STATE_ENV, Path.home() / ".cache" / "kubealign-docker"))


def _socket() -> Path:
    return state_dir() / "docker.sock"


def _client(base_url: str, timeout: float = 600) -> Any:
    import docker

    return docker.DockerClient(base_url=base_url, timeout=timeout)


def answers(base_url: str) -> bool:
    """Whether a daemon answers a ping at base_url (within 5 s)."""
    try:
        client = _client(base_url, timeout=5)
    except Exception:
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def docker_host() -> str | None:
    """The daemon to use (see module docstring), or None when none answers."""
    if os.environ.get("DOCKER_HOST"):
        return os.environ["DOCKER_HOST"]
    for sock in (_socket(), SYSTEM_SOCKET):
        if sock.exists() and answers(f"unix://{sock}"):
            return f"unix://{sock}"
    return None


def client() -> Any:
    """A docker SDK client for docker_host(); a UserError saying how to get a daemon when none answers."""
    host = docker_host()
    if host is None:
        raise UserError(
            "no Docker daemon answers ($DOCKER_HOST unset, no kubealign daemon, no /var/run/docker.sock): "
            "start one with `kubealign images daemon start`"
        )
    if not answers(host):
        raise UserError(f"the Docker daemon at {host} ($DOCKER_HOST) does not answer")
    return _client(host)


def running() -> bool:
    """Whether the private daemon answers on its socket."""
    return _socket().exists() and answers(f"unix://{_socket()}")


def start(timeout_s: float = 90) -> str:
    """Start the private daemon unless it already runs; returns its DOCKER_HOST value."""
    url = f"unix://{_socket()}"
    if running():
        return url
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise UserError("dockerd is not installed: `apt-get install docker.io` (Debian/Ubuntu, as root)")
    if os.geteuid() != 0:
        raise UserError("starting dockerd needs root; or point $DOCKER_HOST at a daemon you can use")
    state = state_dir()
    state.mkdir(parents=True, exist_ok=True)
    _socket().unlink(missing_ok=True)  # left by a daemon that was killed: it answers nothing
    command = [
        dockerd,
        f"--data-root={state / 'data'}",
        f"--exec-root={state / 'exec'}",
        f"--pidfile={state / 'dockerd.pid'}",
        f"--host={url}",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
    ]
    with (state / "dockerd.log").open("ab") as log:
        # its own session: the daemon outlives this command (`kubealign images daemon stop` ends it)
        subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _socket().exists() and answers(url):
            return url
        time.sleep(0.5)
    raise UserError(f"dockerd did not answer within {timeout_s:.0f} s; its log: {state / 'dockerd.log'}")


def pid() -> int | None:
    """The private daemon's pid when it is alive."""
    try:
        value = int((state_dir() / "dockerd.pid").read_text().strip())
        os.kill(value, 0)
    except (OSError, ValueError):
        return None
    return value


def stop(timeout_s: float = 60) -> bool:
    """Stop the private daemon (SIGTERM: it stops its containers); True if one was running."""
    value = pid()
    if value is None:
        return False
    os.kill(value, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(value, 0)
        except OSError:  # gone
            return True
        time.sleep(0.5)
    with contextlib.suppress(OSError):
        os.kill(value, signal.SIGKILL)
    return True
