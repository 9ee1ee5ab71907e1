"""A Label Studio stand-in and a scripted annotator, for the rounds tier (issue 79) and the rehearsal.

The stand-in answers, on 127.0.0.1, the five calls kubealign's client makes (kubealign.feedback.client: find and
create a project, list and import its tasks, export it), in the shapes the recorded exchange of Label Studio 1.23.2
shows (tests/feedback/recorded), keeping projects in memory; it checks the token. The annotator is a person with a
hidden preference the models never see: a score of an answer to a prompt (`prefer(prompt, text)`); it picks the answer it prefers,
flips that choice with probability `noise`, and skips (a cancelled annotation) with probability `skip`.
"""

from __future__ import annotations

import json
import random
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Store:
    def __init__(self, token: str):
        self.token, self.projects, self.lock, self.next_task = token, {}, threading.Lock(), 1

    def add_tasks(self, project: int, tasks: list[dict[str, Any]]) -> int:
        with self.lock:
            for task in tasks:
                self.projects[project]["tasks"].append({"id": self.next_task, "annotations": [], **task})
                self.next_task += 1
        return len(tasks)


def handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def route(self, method: str) -> None:
            if self.headers.get("Authorization") != f"Token {store.token}":
                return self.reply(401, {"detail": "Authentication credentials were not provided."})
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            parts = url.path.strip("/").split("/")
            if (method, url.path) == ("GET", "/api/projects"):
                found = [{"id": i, "title": p["title"]} for i, p in store.projects.items()]
                return self.reply(200, {"results": [p for p in found if p["title"] == query.get("title")]})
            if (method, url.path) == ("POST", "/api/projects"):
                number = len(store.projects) + 1
                store.projects[number] = {"title": body["title"], "label_config": body["label_config"], "tasks": []}
                return self.reply(201, {"id": number, "title": body["title"]})
            if (method, url.path) == ("GET", "/api/tasks"):
                tasks = store.projects[int(query["project"])]["tasks"]
                page, size = int(query.get("page", 1)), int(query.get("page_size", 100))
                return self.reply(200, {"tasks": tasks[(page - 1) * size : page * size]})
            if method == "POST" and parts[-1] == "import":
                return self.reply(201, {"task_count": store.add_tasks(int(parts[2]), body)})
            if method == "GET" and parts[-1] == "export":
                return self.reply(200, store.projects[int(parts[2])]["tasks"])
            return self.reply(404, {"detail": "Not found."})

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.route("GET")

        def do_POST(self) -> None:  # noqa: N802
            self.route("POST")

    return Handler


class LabelStudioStandIn:
    """with LabelStudioStandIn(token) as ls: ls.url answers; ls.store holds the projects."""

    def __init__(self, token: str):
        self.store = Store(token)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler(self.store))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LabelStudioStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def annotate(
    tasks: list[dict[str, Any]],
    prefer: Callable[[str, str], float],
    noise: float,
    skip: float,
    seed: int,
    who: int = 1,
    skip_level: bool = False,
) -> dict[str, int]:
    """The scripted person's annotation of every task nobody annotated yet, in place; the counts of what it did.
    skip_level: a pair it finds equally good (prefer level) is skipped, not given to the left answer (counted as
    "level": a person with no preference between two answers skips rather than toss a coin)."""
    rng = random.Random(f"annotator-{seed}-{who}")
    counts = {"chose": 0, "flipped": 0, "skipped": 0, "level": 0}
    for task in tasks:
        if task["annotations"]:
            continue
        data = task["data"]
        first, second = prefer(data["prompt"], data["answer1"]), prefer(data["prompt"], data["answer2"])
        level = skip_level and first == second
        if rng.random() < skip or level:
            task["annotations"].append({"completed_by": who, "was_cancelled": True, "result": []})
            counts["level" if level else "skipped"] += 1
            continue
        left = first >= second
        if rng.random() < noise:
            left = not left
            counts["flipped"] += 1
        value = {"selected": "left" if left else "right"}
        result = [{"from_name": "comparison", "to_name": "answer1,answer2", "type": "pairwise", "value": value}]
        task["annotations"].append({"completed_by": who, "was_cancelled": False, "result": result})
        counts["chose"] += 1
    return counts
