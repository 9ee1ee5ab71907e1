"""`kubealign feedback pull` tried as an attacker would, against stand-in Label Studio servers on 127.0.0.1: the
token stays with the origin it was given for, a slow or huge reply is cut by the pull's deadline and size cap, a
malformed export is one line naming the task, the tasks' claims about models are checked against the registry,
the output is never written through a planted link, and a URL with credentials in it is refused. A pull that fails
leaves nothing at the output path and no partial file."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kubealign.cli import main

pytestmark = pytest.mark.unit
TOKEN = "0123456789abcdef0123456789abcdef01234567"
MODEL = "kubealign-actor"  # promote.registered_model's default, which push writes into each task's meta


class Stand(BaseHTTPRequestHandler):
    """Answers with the server's `answer(handler)`; records each request's path and Authorization header."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.seen.append((urlsplit(self.path).path, self.headers.get("Authorization")))
        self.server.answer(self)

    def send_json(self, value: object) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture
def serve() -> Iterator[Callable[[Callable], tuple[str, list]]]:
    """serve(answer) -> (its URL, the requests it saw); stopped after the test."""
    servers = []

    def start(answer: Callable) -> tuple[str, list]:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Stand)
        server.daemon_threads = True
        server.answer, server.seen = answer, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def label_studio(export: object) -> Callable:
    """A stand-in Label Studio with one project, `p` (id 1), whose export is `export` (sent as given)."""

    def answer(handler: Stand) -> None:
        if handler.path.startswith("/api/projects/1/export"):
            handler.send_json(export)
        else:
            handler.send_json([{"id": 1, "title": "p"}])

    return answer


def task(number: int, pick: str = "left", first: str = "challenger:2", second: str = "champion:1", **data) -> dict:
    """An exported task as push writes it, annotated once (pick: the side chosen)."""
    meta = {"answer1": first, "answer2": second, "prompt_sha256": "0" * 64, "registered_model": MODEL}
    value = {"from_name": "comparison", "type": "pairwise", "value": {"selected": pick}}
    return {
        "id": number,
        "data": {"prompt": f"q{number}", "answer1": f"a{number}", "answer2": f"b{number}", **data},
        "meta": {"kubealign": meta},
        "annotations": [{"completed_by": 1, "was_cancelled": False, "result": [value]}],
    }


def pull(url: str, out: Path, *extra: str) -> list[str]:
    return ["feedback", "pull", "--project", "p", "--url", url, "--output", str(out), *extra]


@pytest.fixture
def env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", TOKEN)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("LABEL_STUDIO_URL", raising=False)


def refused(args: list[str], capsys, out: Path) -> str:
    """The one line a refused pull prints (exit 2, no traceback); nothing at or beside the output path."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kubealign: error: "), err
    assert not out.parent.exists() or sorted(p.name for p in out.parent.iterdir()) == []
    return err.strip().removeprefix("kubealign: error: ")


def test_a_redirect_to_another_origin_is_refused_and_the_token_stays_home(serve, env, tmp_path, capsys):
    elsewhere, seen_there = serve(label_studio([task(1)]))

    def redirect(handler: Stand) -> None:
        handler.send_response(302)
        handler.send_header("Location", f"{elsewhere}{handler.path}")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    home, _ = serve(redirect)
    out = tmp_path / "fb" / "human.jsonl"
    line = refused(pull(home, out), capsys, out)
    assert line == (
        f"Label Studio at {home}: GET /api/projects redirects to {elsewhere}, another origin: refused (the token "
        f"is only sent to {home}); set --url / LABEL_STUDIO_URL / feedback.url to the server that answers"
    )
    assert seen_there == []  # not asked at all, so never given the token


def test_a_redirect_within_the_origin_is_followed_with_the_token(serve, env, tmp_path, capsys):
    def answer(handler: Stand) -> None:
        if handler.path.startswith("/moved/"):
            handler.path = handler.path.removeprefix("/moved")
            return label_studio([task(1)])(handler)
        handler.send_response(301)
        handler.send_header("Location", f"/moved{handler.path}")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    url, seen = serve(answer)
    out = tmp_path / "human.jsonl"
    assert main(pull(url, out)) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["prompt"] == "q1"
    assert {who for _, who in seen} == {f"Token {TOKEN}"} and len(seen) == 4


def test_a_server_that_drips_is_cut_at_the_pull_deadline(serve, env, tmp_path, capsys):
    def drip(handler: Stand) -> None:  # one byte every 0.5 s, 8 s in all at most
        if not handler.path.startswith("/api/projects/1/export"):
            return label_studio([])(handler)
        handler.send_response(200)
        handler.send_header("Content-Length", "16")
        handler.end_headers()
        for byte in b"[             ]\n":
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.5)

    url, _ = serve(drip)
    config = tmp_path / "fast.yaml"
    config.write_text("feedback:\n  deadline_s: 2\n")
    out = tmp_path / "fb" / "human.jsonl"
    started = time.monotonic()
    line = refused(pull(url, out, "--config", str(config)), capsys, out)
    assert time.monotonic() - started < 4
    assert line == (
        f"Label Studio at {url}: no whole answer within feedback.deadline_s 2.0 s (GET /api/projects/1/export); "
        "raise it for a large project or a slow server"
    )


def test_an_export_over_the_size_cap_is_refused(serve, env, tmp_path, capsys):
    url, _ = serve(label_studio([task(n, prompt="x" * 100_000) for n in range(1, 30)]))
    config = tmp_path / "small.yaml"
    config.write_text("feedback:\n  max_export_mb: 1\n")
    out = tmp_path / "fb" / "human.jsonl"
    line = refused(pull(url, out, "--config", str(config)), capsys, out)
    assert line == (
        f"Label Studio at {url}: GET /api/projects/1/export answered more than feedback.max_export_mb 1.0 MiB; "
        "raise it for a large project"
    )


def no_prompt() -> dict:
    bad = task(7)
    del bad["data"]["prompt"]
    return bad


MALFORMED = {
    "an object": ({"tasks": [task(1)]}, "a JSON object, not a list of tasks"),
    "meta.kubealign null": (
        [task(1), {**task(7), "meta": {"kubealign": None}}],
        "task 7: meta.kubealign is null, not an object (tasks kubealign pushes say which models answered)",
    ),
    "no data.prompt": ([no_prompt()], "task 7: data.prompt is missing"),
    "a number in meta": ([task(7, first=5)], "task 7: meta.kubealign.answer1 is 5, not 'alias:version'"),
    "a lone surrogate": (
        [task(7, answer2="ok \ud800")],
        "task 7: data.answer2 cannot be written as UTF-8 (a lone surrogate at character 3)",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_export_is_one_line_naming_the_task(name, serve, env, tmp_path, capsys):
    export, message = MALFORMED[name]
    url, _ = serve(label_studio(export))
    out = tmp_path / "fb" / "human.jsonl"
    assert refused(pull(url, out), capsys, out) == f"Label Studio at {url}: project 'p': the export: {message}"


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    """A registry holding kubealign-actor versions 1 and 2, and another model, versions 1 and 2."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    for name in (MODEL, "other-model"):
        client.create_registered_model(name)
        for _ in range(2):
            client.create_model_version(name, (root / "weights").as_uri())
    return uri


def test_a_version_the_registry_does_not_hold_is_refused(serve, env, registry, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    url, _ = serve(label_studio([task(1), task(2, first="challenger:99")]))
    out = tmp_path / "fb" / "human.jsonl"
    assert refused(pull(url, out), capsys, out) == (
        f"Label Studio at {url}: project 'p': the export: task 2: meta.kubealign.answer1 'challenger:99': the "
        f"registry at {registry} has no version 99 of {MODEL!r}"
    )
    other = task(3)
    other["meta"]["kubealign"]["registered_model"] = "nobody-registered-it"
    url, _ = serve(label_studio([other]))
    assert refused(pull(url, out), capsys, out) == (
        f"Label Studio at {url}: project 'p': the export: task 3: meta.kubealign.answer1 'challenger:2': the "
        f"registry at {registry} has no version 2 of 'nobody-registered-it'"
    )


def test_the_judge_reads_feedback_about_its_own_model_only(serve, env, registry, monkeypatch, tmp_path, capsys):
    from kubealign.feedback import lookup

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    url, _ = serve(label_studio([task(1), task(2)]))
    config = tmp_path / "exp.yaml"
    config.write_text(f"tracking:\n  experiment: judged-{tmp_path.name}\n")
    assert main(pull(url, tmp_path / "human.jsonl", "--config", str(config))) == 0, capsys.readouterr().err
    found = lookup.latest(registry, f"judged-{tmp_path.name}", MODEL, "2")
    assert (found.win_rate, found.decided) == (1.0, 2)
    assert lookup.latest(registry, f"judged-{tmp_path.name}", "other-model", "2") is None


def test_a_duplicated_task_counts_once_in_the_win_rate(serve, env, tmp_path, capsys):
    twice = [task(1), {**task(1), "id": 2}, task(3, pick="right")]  # challenger won 1 (twice), lost 3
    url, _ = serve(label_studio(twice))
    out = tmp_path / "human.jsonl"
    assert main(pull(url, out)) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "(2 rows from 2 decided tasks)" in printed and "pending 0, skipped 0, tied 0, duplicates 1" in printed
    assert "human win-rate of challenger: 0.50" in printed


def test_a_planted_partial_link_is_never_written_through(serve, env, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file\n")
    out = tmp_path / "fb" / "human.jsonl"
    out.parent.mkdir()
    (out.parent / ".human.jsonl.partial").symlink_to(victim)
    url, _ = serve(label_studio([task(1)]))
    assert main(pull(url, out)) == 0, capsys.readouterr().err
    assert victim.read_text() == "the user's own file\n"
    assert json.loads(out.read_text())["prompt"] == "q1" and not out.is_symlink()
    assert sorted(p.name for p in out.parent.iterdir() if not p.name.endswith(".db")) == [
        ".human.jsonl.partial",  # the planted link, left as it was
        "human.jsonl",
        "mlartifacts",
    ]


def test_credentials_in_the_url_are_refused_and_never_shown(env, tmp_path, capsys):
    from kubealign.config import load_config
    from kubealign.errors import UserError

    with pytest.raises(UserError) as caught:
        load_config(None, ["feedback.url=http://admin:s3cret@label-studio:80"])
    assert str(caught.value) == (
        "preset tiny-cpu: field 'feedback.url' (from --set): http://***@label-studio:80: credentials do not "
        "belong in Label Studio's URL (it is pinned into the compiled pipeline and printed); the token goes in "
        "LABEL_STUDIO_API_KEY (on a cluster, the Secret feedback.token_secret)"
    )
    out = tmp_path / "fb" / "human.jsonl"
    line = refused(pull("http://admin:s3cret@127.0.0.1:9", out), capsys, out)
    assert line == (
        "--url / LABEL_STUDIO_URL http://***@127.0.0.1:9: credentials do not belong in Label Studio's URL (it is "
        "pinned into the compiled pipeline and printed); the token goes in LABEL_STUDIO_API_KEY (on a cluster, the "
        "Secret feedback.token_secret)"
    )
