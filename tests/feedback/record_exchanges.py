"""Records the Label Studio exchanges `make test` replays (tests/feedback/recorded/*.json) against a real server:

    python -m tests.feedback.record_exchanges URL ADMIN_TOKEN [OUT_DIR]

on a fresh Label Studio (no project yet; legacy API tokens allowed, as test_labelstudio.SETUP allows them). The
data sent are the recorded files' own (`pushed`, `first`, `again`), so the tests' expectations stay what they
are; the calls kubealign makes and the replies are what the server says now. Run it again when kubealign's calls
change (the project's label config, a new call) or for a new Label Studio release (its version in the names).

1. label-studio-VERSION.json: the client finds no project, creates it (tasks.LABEL_CONFIG), imports 4 tasks,
   lists them; then, unrecorded, one person chooses left on task 1 and right on task 2 (the labelling page's own
   result format: tests/feedback/annotate_page.py), skips task 3, leaves task 4; the export is recorded.
2. label-studio-VERSION-pull.json: `kubealign feedback pull`'s calls on that project.
3. label-studio-VERSION-push.json: push.push_tasks twice into a new project: 3 tasks, then 3 of which 2 are there.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

from kubealign.feedback import pairs, push
from kubealign.feedback.client import LabelStudio

RECORDED = Path(__file__).parent / "recorded"


class Recording(LabelStudio):
    """A client that keeps each call and its reply."""

    def __init__(self, url: str, token: str):
        super().__init__(url, token)
        self.calls: list[dict[str, Any]] = []

    def call(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None) -> Any:
        reply = super().call(method, path, body, query)
        self.calls.append({"method": method, "path": path, "query": query, "body": body, "reply": reply})
        return reply


def choice(pick: str | None) -> dict[str, Any]:
    """An annotation as the labelling page submits it (None: skipped)."""
    if pick is None:
        return {"result": [], "was_cancelled": True}
    value = {"from_name": "comparison", "to_name": "comparison", "type": "pairwise", "value": {"selected": pick}}
    return {"result": [{**value, "origin": "manual"}], "was_cancelled": False}


def main(url: str, token: str, out: Path) -> None:
    version = LabelStudio(url, token).call("GET", "/api/version")["release"]
    about = {"label_studio": version, "recorded": datetime.date.today().isoformat()}
    old = {name: json.loads((RECORDED / f"label-studio-1.23.2{name}.json").read_text()) for name in ("", "-push")}
    main_ex = Recording(url, token)
    assert main_ex.find_project("kubealign-feedback") is None, "record on a fresh Label Studio"
    project = main_ex.create_project("kubealign-feedback", pairs.LABEL_CONFIG)
    main_ex.import_tasks(project, old[""]["pushed"])
    listed = main_ex.tasks(project)
    person = LabelStudio(url, token)
    for task, pick in zip(sorted(listed, key=lambda t: t["id"])[:3], ("left", "right", None), strict=True):
        person.call("POST", f"/api/tasks/{task['id']}/annotations", choice(pick))
    main_ex.export(project)
    how = "kubealign.feedback.client against label-studio start on 127.0.0.1 (tests/feedback/record_exchanges.py)"
    write(out / f"label-studio-{version}.json", {"about": {**about, "how": how}, "pushed": old[""]["pushed"]}, main_ex)
    pull = Recording(url, token)
    pull.export(pull.find_project("kubealign-feedback"))
    how = "kubealign feedback pull's calls, after the exchange of the file without a suffix"
    write(out / f"label-studio-{version}-pull.json", {"about": {**about, "how": how}}, pull)
    pushing = Recording(url, token)
    push.push_tasks(pushing, "kubealign-push-recorded", old["-push"]["first"])
    push.push_tasks(pushing, "kubealign-push-recorded", old["-push"]["again"])
    how = "kubealign.feedback.push.push_tasks twice against label-studio start on 127.0.0.1"
    data = {"about": {**about, "how": how}, "first": old["-push"]["first"], "again": old["-push"]["again"]}
    write(out / f"label-studio-{version}-push.json", data, pushing)


def write(path: Path, head: dict[str, Any], recording: Recording) -> None:
    path.write_text(json.dumps({**head, "calls": recording.calls}, indent=1, ensure_ascii=False) + "\n")
    print(f"{path}: {len(recording.calls)} calls")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]) if len(sys.argv) > 3 else RECORDED)
