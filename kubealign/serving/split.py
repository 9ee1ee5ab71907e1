"""The local traffic split: `kubealign serve --canary ALIAS` runs the stable alias's server and the
canary's, and this front before them on the port asked for, as KServe's `spec.canary` splits one
InferenceService's traffic in the cluster.

Request k (counted from 0) goes to the canary when floor((k+1)·p/100) > floor(k·p/100): exactly p of every
100 consecutive requests, spread evenly (10 %: requests 9, 19, 29, ...). Deterministic, so the share is the
one asked for over any 100 requests and a test can count it (KServe's split is random). Each answer carries
`x-kubealign-served: ALIAS@VERSION`, the model that answered it. Streams pass through as they come.

Only requests under /v1/ count in the split; anything else (a health probe, /metrics) goes to the stable
server and takes no canary slot.

Control, for the judge acting on its verdict (kubealign.serving.carry_out.in_local): GET /kubealign/route says
who is served (each backend's own URL, which the judge asks directly); POST /kubealign/route
{"only": VERSION} makes that version the whole service; `kubealign serve` then stops the other server.
The front listens on 127.0.0.1 only, but any web page open in a local browser can send it requests: the
control route needs the serve's token (`Authorization: Bearer`, from a 0600 file only this user reads, see
`token_file`), a loopback Host and, to change the route, a JSON body; it is matched on the raw request path.
Bodies are capped (413), a malformed length or path is a 400, an idle client is dropped after
`IDLE_TIMEOUT_S` and at most `MAX_CONNECTIONS` requests are served at once (503 beyond).
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import os
import secrets
import threading
import urllib.parse
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubealign.errors import UserError

ROUTE_PATH = "/kubealign/route"
SERVED_HEADER = "x-kubealign-served"
# hop-by-hop headers (RFC 9110 7.6.1) and the ones the front sets itself are not forwarded, either way
_NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}
    | {"proxy-connection", SERVED_HEADER}
)
MAX_BODY_BYTES = 16 * 2**20  # a completions request is kilobytes; the cap keeps a client from filling memory
IDLE_TIMEOUT_S = 60.0  # a client that sends nothing for this long is dropped (its thread freed)
MAX_CONNECTIONS = 64  # requests served at once; more get a 503 (vLLM queues far fewer on CPU)
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}


class BadRequest(Exception):
    """A request the front refuses before forwarding it: the status and the one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def token_file(port: int) -> Path:
    """Where `kubealign serve --canary` keeps the token of its front on `port` (0600, in a 0700 directory)."""
    from kubealign.config.cache import cache_root

    return cache_root() / "fronts" / f"127.0.0.1-{port}.token"


def new_token(port: int) -> str:
    """A fresh token for the front on `port`, written where `token_file` says, readable by this user only."""
    path = token_file(port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token)
    os.replace(tmp, path)  # a planted link at `path` is replaced, never written through
    return token


def read_token(front: str) -> str:
    """The token of the local front at URL `front`, from its token file; a missing one is one line."""
    port = urllib.parse.urlsplit(front).port
    path = token_file(port or 80)
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UserError(
            f"--front {front}: cannot read its token {path} ({exc.strerror or exc}): the front is "
            "`kubealign serve --canary` on this machine, run by this user"
        ) from None


def forwarded(message: Any) -> list[tuple[str, str]]:
    """The headers of `message` (a request's or a reply's) that go on: not hop-by-hop, not named in its
    Connection:, not the front's own answer label."""
    named = {part.strip().lower() for value in message.get_all("Connection") or [] for part in value.split(",")}
    return [(k, v) for k, v in message.items() if k.lower() not in _NOT_FORWARDED and k.lower() not in named]


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

    def pick(self, counted: bool = True) -> Backend:
        """The backend of the next request; one not `counted` (not an API call) goes to the stable server."""
        with self._lock:
            if not counted:
                return self.stable
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

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # the socket's timeout: an idle client is dropped
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: vLLM's own log has every request
        pass

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _raw_path(self) -> str:
        """The path as the client sent it (http.server folds a leading "//" into "/" in self.path)."""
        parts = self.requestline.split()
        raw = parts[1] if len(parts) >= 2 else ""
        if not raw.startswith("/") or raw.startswith("//"):
            raise BadRequest(400, f"the request path must start with one '/': {raw[:80]!r}")
        return raw

    def _body(self) -> bytes:
        chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
        lengths = self.headers.get_all("Content-Length") or []
        if chunked and lengths:
            raise BadRequest(400, "both Content-Length and Transfer-Encoding: chunked")
        if chunked:
            return self._chunks()
        if not lengths:
            return b""
        if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
            raise BadRequest(400, f"Content-Length must be one number of bytes: {', '.join(lengths)[:80]!r}")
        length = int(lengths[0])
        if length > self.server.max_body_bytes:
            raise BadRequest(413, f"the body is {length} bytes, over the front's {self.server.max_body_bytes}")
        return self.rfile.read(length)

    def _chunks(self) -> bytes:
        """A chunked request body, whole (forwarded with its length); over the cap: 413."""
        body = bytearray()
        while True:
            line = self.rfile.readline(1024).split(b";")[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                raise BadRequest(400, f"a malformed chunk size {line[:40]!r}") from None
            if size < 0 or len(body) + size > self.server.max_body_bytes:
                raise BadRequest(413, f"the chunked body is over the front's {self.server.max_body_bytes} bytes")
            if size == 0:
                while self.rfile.readline(1024).strip():  # trailer fields: dropped
                    pass
                return bytes(body)
            body += self.rfile.read(size)
            self.rfile.readline(1024)  # the CRLF after the chunk

    def _handle(self) -> None:
        try:
            raw = self._raw_path()
            body = self._body()
            if raw.split("?", 1)[0] == ROUTE_PATH:
                self._control(body)
            else:
                self._forward(body, counted=raw.startswith("/v1/"))
        except BadRequest as exc:
            self._reply(exc.status, {"error": str(exc)})

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

    def _control(self, body: bytes) -> None:
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].lower()
        if host not in _LOOPBACK_HOSTS:
            raise BadRequest(403, f"the route answers requests to a loopback host only, not {host[:80]!r}")
        given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.server.token.encode()):
            raise BadRequest(401, f"the route needs this front's token (from {token_file(self.server.port)})")
        if self.command == "GET":
            self._reply(200, self.server.route.describe())
            return
        if self.command != "POST":
            raise BadRequest(405, "the route is GET or POST")
        if (self.headers.get("Content-Type") or "").split(";")[0].strip().lower() != "application/json":
            raise BadRequest(415, "the route's body is JSON (Content-Type: application/json)")
        try:
            version = str(json.loads(body)["only"])
        except (ValueError, KeyError, TypeError):
            raise BadRequest(400, 'the body is {"only": VERSION}') from None
        try:
            action = self.server.route.only(version)
        except KeyError:
            served = ", ".join(b.label for b in self.server.route.served())
            raise BadRequest(409, f"version {version} is not served here (served: {served})") from None
        self._reply(200, {"action": action, **self.server.route.describe()})

    def _forward(self, body: bytes, counted: bool) -> None:
        backend = self.server.route.pick(counted)
        target = urllib.parse.urlsplit(backend.url)
        headers = dict(forwarded(self.headers))
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=self.server.timeout_s)
        sent = False
        try:
            conn.request(self.command, self.path, body=body if body or self.command != "GET" else None, headers=headers)
            reply = conn.getresponse()
            self.send_response(reply.status, reply.reason)
            for key, value in forwarded(reply.msg):
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

    def __init__(self, port: int, route: Route, timeout_s: float, token: str, limits: Limits) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.route, self.timeout_s, self.token, self.port = route, timeout_s, token, port
        self.max_body_bytes, self.idle_timeout_s = limits.max_body_bytes, limits.idle_timeout_s
        self.max_connections = limits.max_connections
        self._slots = threading.BoundedSemaphore(limits.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per request up to MAX_CONNECTIONS; beyond that a 503, answered here and closed."""
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": f"the front serves {self.max_connections} requests at once; try again"})
            with contextlib.suppress(OSError):
                request.sendall(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def stop(self) -> None:
        """Stop serving, free the port and remove the token file (when it is still this front's)."""
        self.shutdown()
        self.server_close()
        path = token_file(self.port)
        with contextlib.suppress(OSError):
            if path.read_text(encoding="utf-8").strip() == self.token:
                path.unlink()


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = MAX_BODY_BYTES
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


def start(port: int, route: Route, timeout_s: float = 600.0, limits: Limits = Limits()) -> _Front:
    """The front on 127.0.0.1:port, serving in a daemon thread, its control token written to `token_file`
    (the judge reads it there); `.stop()` stops it."""
    front = _Front(port, route, timeout_s, new_token(port), limits)
    threading.Thread(target=front.serve_forever, name="kubealign-split", daemon=True).start()
    return front


def _control(front: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """GET (or POST `body` to) the front's route; a front that does not answer, or refuses, is one line."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(front.rstrip("/") + ROUTE_PATH, data=data, method="POST" if data else "GET")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {read_token(front)}")
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
