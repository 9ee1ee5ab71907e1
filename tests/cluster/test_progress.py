"""The ppo stage's progress on its TrainJob (kubealign.cluster.progress): the status.trainerStatus it posts is
valid under Kubeflow Trainer v2.3's TrainJob CRD (../shared/k8s-schemas), and the POST goes as the Trainer's
status server takes it (docs/user-guides/trainjob-progress.md of kubeflow/trainer v2.3.0): to
KUBEFLOW_TRAINER_SERVER_URL, the token file read for each call, throttled, never raising."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kubealign.cluster import progress
from tests.cluster.test_trainjob import two_by_eight
from tests.support.k8s_schemas import errors

METRICS = {"reward_mean": 0.25, "kl": 0.0123456789, "policy_loss": float("nan"), "samples_per_s": 3.5, "x": 1.0}
NOW = datetime(2026, 12, 6, 22, 0, 0, tzinfo=UTC)


def with_status(status: dict) -> dict:
    return two_by_eight() | {"status": {"trainerStatus": status}}


def test_the_status_validates_against_the_trainjob_crd():
    status = progress.trainer_status(3, 10, 60.0, METRICS, NOW)
    assert errors(with_status(status)) == []
    assert status["progressPercentage"] == 30 and status["estimatedRemainingSeconds"] == 140  # 20 s each, 7 left
    assert status["lastUpdatedTime"] == "2026-12-06T22:00:00Z"  # the CEL rule: lastUpdatedTime is required
    assert status["metrics"] == [  # the SHOWN ones that are finite, as strings
        {"name": "reward_mean", "value": "0.25"},
        {"name": "kl", "value": "0.0123457"},
        {"name": "samples_per_s", "value": "3.5"},
    ]
    before = progress.trainer_status(0, 10, 0.0, {}, NOW)
    assert errors(with_status(before)) == [] and "estimatedRemainingSeconds" not in before
    resumed = progress.trainer_status(6, 10, 30.0, {}, NOW, first=4)  # two iterations in 30 s since the resume
    assert resumed["progressPercentage"] == 60 and resumed["estimatedRemainingSeconds"] == 60
    # the schema check is real: what the CRD refuses is refused here
    bad = dict(status, progressPercentage=101, metrics=[{"name": "", "value": "1"}], extra=1)
    assert len(errors(with_status(bad))) == 3


class Server:
    """The Trainer's status server, standing in on 127.0.0.1 (plain HTTP: TLS is urllib's with the CA file)."""

    def __init__(self, code: int = 200):
        self.posts: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts.append((self.path, self.headers["Authorization"], body))
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/namespaces/a/trainjobs/j/status"

    def stop(self):
        self.server.shutdown()


def test_rank_zero_posts_throttled_with_the_current_token(tmp_path: Path, capsys):
    server, token = Server(), tmp_path / "token"
    token.write_text("t-1\n")
    env = {progress.URL_ENV: server.url, progress.CA_ENV: str(tmp_path / "ca.crt"), progress.TOKEN_ENV: str(token)}
    now = [100.0]
    reporter = progress.Reporter(True, environ=env, clock=lambda: now[0])
    try:
        assert reporter.report(1, 4, METRICS)
        now[0] += 1.0
        assert not reporter.report(2, 4, METRICS)  # within 5 s of the last: not sent
        token.write_text("t-2")  # the projected token rotated
        now[0] += 1.0
        assert reporter.report(4, 4, METRICS, final=True)  # the end is always sent
    finally:
        server.stop()
    assert [(p[0].endswith("/trainjobs/j/status"), p[1]) for p in server.posts] == [
        (True, "Bearer t-1"),
        (True, "Bearer t-2"),
    ]
    for _, _, body in server.posts:
        assert list(body) == ["trainerStatus"] and errors(with_status(body["trainerStatus"])) == []
    assert server.posts[-1][2]["trainerStatus"]["progressPercentage"] == 100
    assert not progress.Reporter(False, environ=env).report(1, 4, METRICS, final=True)  # other ranks: never
    assert not progress.Reporter(True, environ={}).report(1, 4, METRICS, final=True)  # outside a TrainJob: nothing


def test_a_failing_status_server_is_one_line_and_never_stops_training(tmp_path: Path, capsys):
    server, token = Server(code=500), tmp_path / "token"
    token.write_text("t")
    env = {progress.URL_ENV: server.url, progress.TOKEN_ENV: str(token)}
    reporter = progress.Reporter(True, environ=env)
    try:
        assert not reporter.report(1, 2, METRICS, final=True)
        assert not reporter.report(2, 2, METRICS, final=True)
    finally:
        server.stop()
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "could not report progress" in said[0] and "500" in said[0]
