"""Label Studio's HTTP API, as much of it as `kubealign feedback` needs: find or create a project,
list the prompts of its tasks, import tasks, export the annotated ones.

Connection as Label Studio's own tools take it: the URL from --url or LABEL_STUDIO_URL, the token from
LABEL_STUDIO_API_KEY (a legacy API token, sent as `Authorization: Token ...`). Every failure is one line with
the fix: a server that is down, a token it refuses, a project that is not there, a reply that is not JSON.

The token goes to the URL's origin (scheme, host, port) and nowhere else: a redirect within it is followed, one
to another origin is refused (a reply from a server nobody configured is not Label Studio's, and following it
without the token would only end in a misleading 401). A pull has one deadline for all its calls (a server that
answers a byte at a time cannot hold it past `feedback.deadline_s`), each reply a size cap
(`feedback.max_export_mb`), and a URL with credentials in it is refused before anything is sent.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kubealign.config.feedback import credentials_refusal
from kubealign.errors import UserError

URL_ENV, TOKEN_ENV = "LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY"
PAGE = 100  # tasks per page when listing a project's tasks
CHUNK = 1 << 16  # bytes read at a time from a reply


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, the port made explicit."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


class _Elsewhere(Exception):
    """A redirect to another origin (its URL), raised out of urllib before the request is sent."""


class _SameOrigin(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 (urllib's signature)
        if origin(newurl) != origin(req.full_url):
            raise _Elsewhere(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Watch:
    """Shuts the connections of one call at its deadline: a read blocked on a dripping server returns then."""

    def __init__(self, until: float):
        self.until, self.cut, self.timers = until, False, []

    def connection(self, base: type, *args: Any, **kwargs: Any) -> Any:
        watch = self

        class Watched(base):
            def connect(self) -> None:
                super().connect()
                timer = threading.Timer(max(0.0, watch.until - time.monotonic()), watch.shut, (self.sock,))
                timer.daemon = True
                watch.timers.append(timer)
                timer.start()

        return Watched(*args, **kwargs)

    def shut(self, sock: socket.socket) -> None:
        self.cut = True
        with contextlib.suppress(OSError):  # closed already
            sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        for timer in self.timers:
            timer.cancel()


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def http_open(self, req):  # noqa: ANN001, ANN201 (urllib's signature)
        return self.do_open(functools.partial(self.watch.connection, http.client.HTTPConnection), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch):
        super().__init__()
        self.watch = watch

    def https_open(self, req):  # noqa: ANN001, ANN201 (urllib's signature)
        connection = functools.partial(self.watch.connection, http.client.HTTPSConnection)
        return self.do_open(connection, req, context=self._context)


class LabelStudio:
    """deadline_s: how long one call may take, or all calls after `start()` together (a pull); max_bytes: the
    largest reply read (the export is the largest)."""

    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float = 30.0,
        deadline_s: float = 600.0,
        max_bytes: int = 256 << 20,
    ):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{URL_ENV} / --url: {url!r} is not an http(s) URL")
        refusal = credentials_refusal(url)
        if refusal:
            raise UserError(f"--url / {URL_ENV} {refusal}")
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self.deadline_s, self.max_bytes, self.until = deadline_s, max_bytes, None

    def start(self) -> None:
        """From now on, every call ends within deadline_s of now, all together."""
        self.until = time.monotonic() + self.deadline_s

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        """One API call; the reply's JSON (None for an empty body)."""
        where = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Authorization": f"Token {self.token}", "Content-Type": "application/json"}
        request = urllib.request.Request(where, data=data, headers=headers, method=method)
        until = self.until if self.until is not None else time.monotonic() + self.deadline_s
        watch = _Watch(until)
        try:
            text = self._read(request, watch, f"{method} {path}")
        except _Elsewhere as exc:
            there = "{}://{}:{}".format(*origin(str(exc)))
            raise UserError(
                f"Label Studio at {self.url}: {method} {path} redirects to {there}, another origin: refused (the "
                f"token is only sent to {self.url}); set --url / {URL_ENV} / feedback.url to the server that answers"
            ) from None
        except urllib.error.HTTPError as exc:
            raise UserError(self._refused(exc.code, method, path, exc.read()[:200])) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            if watch.cut or time.monotonic() >= until:
                raise UserError(self._late(method, path)) from None
            reason = getattr(exc, "reason", exc)
            raise UserError(f"Label Studio at {self.url} cannot be reached ({reason}): is it running?") from None
        finally:
            watch.stop()
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            raise UserError(
                f"Label Studio at {self.url}: {method} {path} answered with no JSON: {text[:80]!r}"
            ) from None

    def _read(self, request: urllib.request.Request, watch: _Watch, what: str) -> bytes:
        """The reply's body, at most max_bytes of it; the deadline bounds the connect and every read."""
        left = watch.until - time.monotonic()
        if left <= 0:
            raise UserError(self._late(*what.split(" ", 1)))
        opener = urllib.request.build_opener(_SameOrigin, _HTTP(watch), _HTTPS(watch))
        with opener.open(request, timeout=min(self.timeout_s, left)) as reply:
            declared = reply.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise UserError(self._too_big(what))
            parts, size = [], 0
            while chunk := reply.read(CHUNK):
                parts.append(chunk)
                size += len(chunk)
                if size > self.max_bytes:
                    raise UserError(self._too_big(what))
        if watch.cut:  # shut at the deadline between two reads: what came may be cut short
            raise UserError(self._late(*what.split(" ", 1)))
        return b"".join(parts)

    def _late(self, method: str, path: str) -> str:
        return (
            f"Label Studio at {self.url}: no whole answer within feedback.deadline_s {self.deadline_s} s "
            f"({method} {path}); raise it for a large project or a slow server"
        )

    def _too_big(self, what: str) -> str:
        return (
            f"Label Studio at {self.url}: {what} answered more than feedback.max_export_mb "
            f"{self.max_bytes / (1 << 20)} MiB; raise it for a large project"
        )

    def _refused(self, code: int, method: str, path: str, text: bytes) -> str:
        if code == 401:
            return f"Label Studio at {self.url} refused the token ({TOKEN_ENV}): HTTP 401"
        if code == 403:
            return f"Label Studio at {self.url}: the token's user may not {method} {path} (HTTP 403)"
        if code == 404:
            return f"Label Studio at {self.url}: {path} not found (HTTP 404): no such project?"
        return f"Label Studio at {self.url}: {method} {path} failed with HTTP {code}: {text.decode(errors='replace')}"

    def find_project(self, title: str) -> int | None:
        """The id of the project with this title, None if there is none."""
        found = self.call("GET", "/api/projects", query={"title": title, "page_size": PAGE})
        projects = found.get("results", []) if isinstance(found, dict) else found
        if not isinstance(projects, list) or not all(isinstance(p, dict) and "id" in p for p in projects):
            raise UserError(f"Label Studio at {self.url}: GET /api/projects answered no list of projects")
        return next((p["id"] for p in projects if p.get("title") == title), None)

    def create_project(self, title: str, label_config: str) -> int:
        return self.call("POST", "/api/projects", {"title": title, "label_config": label_config})["id"]

    def tasks(self, project: int) -> list[dict[str, Any]]:
        """Every task of the project (page by page)."""
        out, page = [], 1
        while True:
            found = self.call("GET", "/api/tasks", query={"project": project, "page": page, "page_size": PAGE})
            batch = found.get("tasks", []) if isinstance(found, dict) else found
            out += batch
            if len(batch) < PAGE:
                return out
            page += 1

    def import_tasks(self, project: int, tasks: list[dict[str, Any]]) -> int:
        """Add the tasks; how many Label Studio says it added."""
        reply = self.call("POST", f"/api/projects/{project}/import", tasks)
        return int(reply.get("task_count", len(tasks))) if isinstance(reply, dict) else len(tasks)

    def export(self, project: int) -> list[dict[str, Any]]:
        """Every task of the project with its annotations (Label Studio's JSON export; all tasks, not only the
        annotated ones, so that those nobody has looked at yet are counted)."""
        query = {"exportType": "JSON", "download_all_tasks": "true"}
        return self.call("GET", f"/api/projects/{project}/export", query=query)


def connect(url: str | None, settings: Any = None) -> LabelStudio:
    """A client of the Label Studio at `url` (else $LABEL_STUDIO_URL, else http://localhost:8080) with the token in
    $LABEL_STUDIO_API_KEY, its deadline and size cap from `settings` (the feedback section; else the defaults);
    one line when the token is not set."""
    import os

    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise UserError(f"{TOKEN_ENV} is not set: Label Studio's API token (Account & Settings -> Legacy Token)")
    limits = {} if settings is None else {"deadline_s": settings.deadline_s, "max_bytes": settings.max_bytes}
    return LabelStudio(url or os.environ.get(URL_ENV) or "http://localhost:8080", token, **limits)
