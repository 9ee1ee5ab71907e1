"""Real parts for the fault-injection tier (`pytest -m faults`): an `mlflow server` on 127.0.0.1 that a
test can kill, and a small HTTP proxy in front of it that answers chosen requests with an error.

Everything listens on loopback ports picked by the OS and every wait is bounded.
"""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

START_TIMEOUT_S = 90  # `mlflow server` takes 5-20 s to answer /health on 2 busy cores


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """`mlflow server` with a sqlite backend and served artifacts under `root`, in its own process group.

    `command` (listening on 127.0.0.1:`port`) and `env` replace that default server: the chart's own
    command line, for instance (tests/faults/test_production_stores.py)."""

    def __init__(self, root: Path, command: list[str] | None = None, env: dict[str, str] | None = None, port: int = 0):
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.command, self.env = command, env

    def start(self) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = self.command or [
            str(mlflow),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
        ]
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.kill()
        raise RuntimeError(f"mlflow server on {self.url} did not answer /health in {START_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL the server and its workers (the whole process group)."""
        if self.proc is not None and self.proc.poll() is None:
            import os

            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


Rule = Callable[[str, str, bytes], int | None]
"""(method, path, body) -> an HTTP status to answer instead of forwarding, or None to forward."""


class FaultProxy:
    """Forwards HTTP to `upstream` and answers with an error where a rule says so.

    `rules` are tried in order for each request; `log` records (method, path, status answered).
    `dead` makes every later request fail the way a dead server does (connection closed, no answer).
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, int]] = []
        self.dead = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.dead:
                    proxy.log.append((self.command, self.path, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                for rule in proxy.rules:
                    status = rule(self.command, self.path, body)
                    if status is not None:
                        proxy.log.append((self.command, self.path, status))
                        payload = b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "injected fault"}'
                        if status == 404:
                            payload = b'{"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "injected"}'
                        self.send_response(status)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                proxy.log.append((self.command, self.path, reply.status))
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fail_when(method: str, path_part: str, status: int = 503, times: int | None = None) -> Rule:
    """A rule answering `status` to requests of `method` whose path contains `path_part` (`times` at most)."""
    left = [times]

    def rule(m: str, path: str, body: bytes) -> int | None:
        if m == method and path_part in path and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            return status
        return None

    return rule
