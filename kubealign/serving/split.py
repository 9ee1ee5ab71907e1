"""The local traffic split (issue 39): `kubealign serve --canary ALIAS` runs the stable alias's server and the
canary's, and this front before them on the port asked for, as KServe's `spec.canary` splits one
InferenceService's traffic in the cluster.

Request k (counted from 0) goes to the canary when floor((k+1)·p/100) > floor(k·p/100): exactly p of every
100 consecutive requests, spread evenly (10 %: requests 9, 19, 29, ...). Deterministic, so the share is the
one asked for over any 100 requests and a test can count it (KServe's split is random). Each answer carries
`x-kubealign-served: ALIAS@VERSION`, the model that answered it. Streams pass through as they come.

Control, for the judge acting on its verdict (kubealign.serving.act.in_local): GET /kubealign/route says
who is served (each backend's own URL, which the judge asks directly); POST /kubealign/route
{"only": VERSION} makes that version the whole service; `kubealign serve` then stops the other server.
The front listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import urllib.parse
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROUTE_PATH = "/kubealign/route"
SERVED_HEADER = "x-kubealign-served"
# hop-by-hop headers (RFC 9110 7.6.1) and the ones the front sets itself are not forwarded
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def to_canary(k: int, percent: int) -> bool:
    """Whether request k (from 0) is the canary's: p of every 100, evenly spread."""
    return (k + 1) * percent // 100 > k * percent // 100


@dataclass(frozen=True)
class Backend:
    alias: str
    version: str
    url: str  # http://127.0.0.1:PORT, the server's own address

    @property
    def label(self) -> str:
        return f"{self.alias}@{self.version}"


class Route:
    """Who answers: the stable backend, and the canary with its share until one version is made the whole
    service. Thread-safe; `changed` is set when the route changes (serve then stops the server left out)."""

    def __init__(self, stable: Backend, canary: Backend | None, percent: int) -> None:
        self.stable, self.canary, self.percent = stable, canary, percent
        self.requests = 0
        self.changed = threading.Event()
        self._lock = threading.Lock()

    def pick(self) -> Backend:
        with self._lock:
            k, self.requests = self.requests, self.requests + 1
            if self.canary is not None and to_canary(k, self.percent):
                return self.canary
            return self.stable

    def only(self, version: str) -> str:
        """Serve `version` alone: "updated", or "unchanged" when it already is; KeyError when no backend has it."""
        with self._lock:
            if self.canary is None and self.stable.version == version:
                return "unchanged"
            chosen = [b for b in (self.stable, self.canary) if b is not None and b.version == version]
            if not chosen:
                raise KeyError(version)
            self.stable, self.canary, self.percent = chosen[0], None, 0
        self.changed.set()
        return "updated"

    def served(self) -> list[Backend]:
        with self._lock:
            return [b for b in (self.stable, self.canary) if b is not None]

    def describe(self) -> dict[str, Any]:
        with self._lock:
            canary = asdict(self.canary) if self.canary else None
            return {"stable": asdict(self.stable), "canary": canary, "percent": self.percent}


class _Handler(BaseHTTPRequestHandler):
    server: _Front
    protocol_version = "HTTP/1.0"  # the end of a forwarded stream is the closed connection

    def log_message(self, format: str, *args: Any) -> None:  # quiet: vLLM's own log has every request
        pass

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self) -> None:
        if self.path == ROUTE_PATH:
            self._reply(200, self.server.route.describe())
        else:
            self._forward(b"")

    def do_POST(self) -> None:
        body = self._body()
        if self.path != ROUTE_PATH:
            self._forward(body)
            return
        try:
            version = str(json.loads(body)["only"])
        except (ValueError, KeyError, TypeError):
            self._reply(400, {"error": 'the body is {"only": VERSION}'})
            return
        try:
            action = self.server.route.only(version)
        except KeyError:
            served = ", ".join(b.label for b in self.server.route.served())
            self._reply(409, {"error": f"version {version} is not served here (served: {served})"})
            return
        self._reply(200, {"action": action, **self.server.route.describe()})

    def _forward(self, body: bytes) -> None:
        backend = self.server.route.pick()
        target = urllib.parse.urlsplit(backend.url)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED}
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=self.server.timeout_s)
        sent = False
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            reply = conn.getresponse()
            self.send_response(reply.status, reply.reason)
            for key, value in reply.getheaders():
                if key.lower() not in _NOT_FORWARDED:
                    self.send_header(key, value)
            self.send_header(SERVED_HEADER, backend.label)
            self.end_headers()
            sent = True
            while chunk := reply.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
        except OSError as exc:  # the backend down or timing out: 502 naming it (mid-stream: the stream ends)
            if not sent:
                self._reply(502, {"error": f"{backend.label} at {backend.url}: {exc}"})
        finally:
            conn.close()


class _Front(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, route: Route, timeout_s: float) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.route, self.timeout_s = route, timeout_s

    def stop(self) -> None:
        """Stop serving and free the port."""
        self.shutdown()
        self.server_close()


def start(port: int, route: Route, timeout_s: float = 600.0) -> _Front:
    """The front on 127.0.0.1:port, serving in a daemon thread; `.stop()` stops it."""
    front = _Front(port, route, timeout_s)
    threading.Thread(target=front.serve_forever, name="kubealign-split", daemon=True).start()
    return front


def _control(front: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET (or POST `body` to) the front's route; a front that does not answer, or refuses, is one line."""
    import urllib.error
    import urllib.request

    from kubealign.errors import UserError

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(front.rstrip("/") + ROUTE_PATH, data=data, method="POST" if data else "GET")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        said = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):  # not the front's own JSON error
            said = json.loads(said)["error"]
        raise UserError(f"--front {front}: HTTP {exc.code}: {said}") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"--front {front}: not a kubealign serve --canary front ({exc})") from None


def read_route(front: str) -> dict[str, Any]:
    """The front's route: {"stable": backend, "canary": backend | None, "percent": N}."""
    return _control(front)


def serve_only(front: str, version: str) -> str:
    """Make `version` the front's whole service: "updated" or "unchanged"."""
    return _control(front, {"only": version})["action"]
