"""kubealign's Label Studio client against a recorded exchange with a real Label Studio 1.23.2 (issue 59):
the same calls in the same order, the token sent, the replies read; people's choices in the real export
mapped back to the two registry versions; a server that is down or refuses the token is one line."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from kubealign.errors import UserError
from kubealign.feedback import annotations as an
from kubealign.feedback import pairs
from kubealign.feedback.client import LabelStudio

pytestmark = pytest.mark.unit
RECORDED = json.loads((Path(__file__).parent / "recorded" / "label-studio-1.23.2.json").read_text())
TOKEN = "0123456789abcdef0123456789abcdef01234567"


class Replay(BaseHTTPRequestHandler):
    """Answers each request with the next recorded reply, after checking it is the recorded request."""

    calls: list[dict] = []
    seen: list[str] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        url = urlsplit(self.path)
        expected = self.calls.pop(0)
        query = {k: str(v) for k, v in (expected["query"] or {}).items()}
        assert (self.command, url.path, dict(parse_qsl(url.query)), body) == (
            expected["method"],
            expected["path"],
            query,
            expected["body"],
        )
        self.seen.append(self.headers["Authorization"])
        data = json.dumps(expected["reply"]).encode()
        self.send_response(401 if self.headers["Authorization"] != f"Token {TOKEN}" else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def replay():
    Replay.calls, Replay.seen = [dict(c) for c in RECORDED["calls"]], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_push_then_pull_through_the_recorded_exchange(replay):
    ls = LabelStudio(replay, TOKEN)
    assert ls.find_project("kubealign-feedback") is None
    project = ls.create_project("kubealign-feedback", pairs.LABEL_CONFIG)
    assert project == RECORDED["calls"][1]["reply"]["id"]  # the id the server gave
    assert ls.import_tasks(project, RECORDED["pushed"]) == 4
    listed = ls.tasks(project)
    present = {t["meta"]["kubealign"]["prompt_sha256"] for t in listed}
    assert present == {pairs.prompt_key(t["data"]["prompt"]) for t in RECORDED["pushed"]}
    assert pairs.new_tasks(RECORDED["pushed"], present) == []  # pushing again adds nothing
    out = an.pulled(ls.export(project))
    assert Replay.calls == [] and set(Replay.seen) == {f"Token {TOKEN}"}
    # the real export: task 1 left, task 2 right, task 3 skipped, task 4 not annotated
    pushed = RECORDED["pushed"]
    expected = []
    for task, pick in ((pushed[0], "answer1"), (pushed[1], "answer2")):
        other = "answer2" if pick == "answer1" else "answer1"
        expected.append(
            (task["data"]["prompt"], task["data"][pick], task["data"][other], task["meta"]["kubealign"][pick])
        )
    assert [(r["prompt"], r["chosen"], r["rejected"], r["chosen_by"]) for r in out.rows] == expected
    assert (out.decided, out.pending, out.skipped, out.tied) == (2, 1, 1, 0)


def test_a_refused_token_and_a_server_that_is_down_are_one_line(replay):
    with pytest.raises(UserError, match=r"refused the token \(LABEL_STUDIO_API_KEY\): HTTP 401$"):
        LabelStudio(replay, "wrong").find_project("kubealign-feedback")
    with pytest.raises(UserError, match=r"^Label Studio at http://127.0.0.1:9 cannot be reached .*is it running\?$"):
        LabelStudio("http://127.0.0.1:9", TOKEN, timeout_s=2).find_project("x")
    with pytest.raises(UserError, match="is not an http"):
        LabelStudio("127.0.0.1:8080", TOKEN)


@pytest.fixture
def replay_pull():
    Replay.calls, Replay.seen = [dict(c) for c in PULL["calls"]], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


PULL = json.loads((Path(__file__).parent / "recorded" / "label-studio-1.23.2-pull.json").read_text())


def registry_holding(root: Path, versions: int, model: str = "kubealign-actor") -> str:
    """A sqlite registry under `root` holding versions 1..`versions` of `model` (the recorded tasks name
    kubealign-actor's versions 3 and 4): its URI."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{root / 'registry.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model(model)
    for _ in range(versions):
        client.create_model_version(model, (root / "weights").as_uri())
    return uri


def test_feedback_pull_writes_the_rows_and_logs_the_file_as_a_dataset(replay_pull, tmp_path, monkeypatch, capsys):
    from mlflow import MlflowClient

    from kubealign.cli import main

    registry = registry_holding(tmp_path, 4)
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    out = tmp_path / "fb" / "human.jsonl"
    args = ["feedback", "pull", "--project", "kubealign-feedback", "--url", replay_pull, "--output", str(out)]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    pushed = RECORDED["pushed"]
    assert rows == [
        {
            "prompt": pushed[0]["data"]["prompt"],
            "chosen": pushed[0]["data"]["answer1"],
            "rejected": pushed[0]["data"]["answer2"],
        },
        {
            "prompt": pushed[1]["data"]["prompt"],
            "chosen": pushed[1]["data"]["answer2"],
            "rejected": pushed[1]["data"]["answer1"],
        },
    ]
    printed = capsys.readouterr().out
    wins = sum(
        t["meta"]["kubealign"][pick].startswith("challenger:")
        for t, pick in zip(pushed[:2], ("answer1", "answer2"), strict=True)
    )
    low, high = an.wilson(wins, 2)
    assert "pending 1, skipped 1, tied 0" in printed
    assert f"human win-rate of challenger: {wins / 2:.2f} (95 % interval {low:.2f}-{high:.2f})" in printed
    client = MlflowClient(registry)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (given,) = client.get_run(run.info.run_id).inputs.dataset_inputs
    assert given.dataset.name == "human.jsonl" and given.dataset.source_type == "label-studio"
    assert json.loads(given.dataset.profile)["versions"] == ["challenger:4", "champion:3"]
    assert run.data.metrics["decided"] == 2 and run.data.metrics["human_win_rate"] == wins / 2
    # the online judge's check (canary.min_human_win_rate) finds it by the registered model and challenger's version
    from kubealign.feedback import lookup

    found = lookup.latest(registry, "kubealign-tiny", "kubealign-actor", "4")
    assert (found.win_rate, found.decided) == (wins / 2, 2) and found.source == f"feedback run {run.info.run_id}"
    assert lookup.latest(registry, "kubealign-tiny", "kubealign-actor", "3") is None  # the champion's: none
    assert lookup.latest(registry, "kubealign-tiny", "another-model", "4") is None  # another model's version 4
    assert main(args) == 2  # the file is there: never overwritten
    assert "exists; pull into a new file" in capsys.readouterr().err


PUSH = json.loads((Path(__file__).parent / "recorded" / "label-studio-1.23.2-push.json").read_text())


def test_push_creates_the_project_once_and_adds_only_new_prompts(tmp_path):
    from kubealign.feedback.push import push_tasks

    Replay.calls, Replay.seen = [dict(c) for c in PUSH["calls"]], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = LabelStudio(f"http://127.0.0.1:{server.server_address[1]}", TOKEN)
        made = PUSH["calls"][1]["reply"]["id"]  # the id the server gave the project it created
        assert push_tasks(client, "kubealign-push-recorded", PUSH["first"]) == (made, True, 3, 0)
        # p2 and p3 are there: only p4 goes
        assert push_tasks(client, "kubealign-push-recorded", PUSH["again"]) == (made, False, 1, 2)
    finally:
        server.shutdown()
        server.server_close()
    assert Replay.calls == []
    assert PUSH["calls"][-1]["body"] == [PUSH["again"][2]]  # what the real server was sent the second time


def test_held_out_prompts_from_a_file_name_the_bad_line(tmp_path):
    from kubealign.feedback.push import held_out_prompts

    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    assert held_out_prompts(good, 2) == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not a JSON object with a prompt$"):
        held_out_prompts(bad, 2)
