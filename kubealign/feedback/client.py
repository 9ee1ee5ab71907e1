"""Label Studio's HTTP API, as much of it as `kubealign feedback` needs: find or create a project,
list the prompts of its tasks, import tasks, export the annotated ones.

Connection as Label Studio's own tools take it: the URL from --url or LABEL_STUDIO_URL, the token from
LABEL_STUDIO_API_KEY (a legacy API token, sent as `Authorization: Token ...`). Every failure is one line with
the fix: a server that is down, a token it refuses, a project that is not there, a reply that is not JSON.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kubealign.errors import UserError

URL_ENV, TOKEN_ENV = "LABEL_STUDIO_URL", "LABEL_STUDIO_API_KEY"
PAGE = 100  # tasks per page when listing a project's tasks


class LabelStudio:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"{URL_ENV} / --url: {url!r} is not an http(s) URL")
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        """One API call; the reply's JSON (None for an empty body)."""
        where = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Authorization": f"Token {self.token}", "Content-Type": "application/json"}
        request = urllib.request.Request(where, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                text = reply.read()
        except urllib.error.HTTPError as exc:
            raise UserError(self._refused(exc.code, method, path, exc.read()[:200])) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UserError(f"Label Studio at {self.url} cannot be reached ({reason}): is it running?") from None
        try:
            return json.loads(text) if text.strip() else None
        except ValueError:
            raise UserError(
                f"Label Studio at {self.url}: {method} {path} answered with no JSON: {text[:80]!r}"
            ) from None

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


def connect(url: str | None) -> LabelStudio:
    """A client of the Label Studio at `url` (else $LABEL_STUDIO_URL, else http://localhost:8080) with the token in
    $LABEL_STUDIO_API_KEY; one line when the token is not set."""
    import os

    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise UserError(f"{TOKEN_ENV} is not set: Label Studio's API token (Account & Settings -> Legacy Token)")
    return LabelStudio(url or os.environ.get(URL_ENV) or "http://localhost:8080", token)
