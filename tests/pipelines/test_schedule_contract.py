"""Contract test of `kubealign round schedule` (issue 79): the feedback loop's rounds as a KFP recurring run,
created by kfp.Client against the stand-in of the KFP v2beta1 REST API that test_submit_contract uses; the test
asserts what arrived: the compiled pipeline with its feedback task, the cron trigger, one round at a time."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from tests.pipelines.test_submit_contract import FakeKfpApi

pytestmark = pytest.mark.kfp


class FakeRecurringApi(FakeKfpApi):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path != "/apis/v2beta1/recurringruns":
            return super().do_POST()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, body))
        self._reply(200, {"recurring_run_id": "rr-9", "display_name": body["display_name"], "status": "ENABLED"})


@pytest.fixture
def kfp_api() -> Iterator[tuple[str, list]]:
    FakeKfpApi.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRecurringApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfpApi.calls
    server.shutdown()
    server.server_close()


def test_schedule_creates_a_recurring_run_of_the_rounds(cli, kfp_api) -> None:
    host, calls = kfp_api
    cron = "0 0 3 * * 1"
    result = cli(
        "round", "schedule", "--host", host, "--cron", cron, "--name", "weekly", "--experiment", "rounds",
        "--set", "feedback.project=prefs", "--set", "feedback.budget=32",
    )  # fmt: skip
    assert result.code == 0, result.err
    assert f"{host}/#/recurringrun/details/rr-9" in result.out
    posts = [(p, b) for m, p, b in calls if m == "POST"]
    assert [p for p, _ in posts] == ["/apis/v2beta1/experiments", "/apis/v2beta1/recurringruns"]
    assert posts[0][1]["display_name"] == "rounds"
    job = posts[1][1]
    assert job["display_name"] == "weekly" and job["experiment_id"] == "exp-7"
    assert job["trigger"] == {"cron_schedule": {"cron": cron}}
    assert job["max_concurrency"] == 1 and job["no_catchup"] is True and job["mode"] == "ENABLE"
    spec = job["pipeline_spec"]["pipeline_spec"]
    tasks = spec["root"]["dag"]["tasks"]
    assert "feedback" in tasks and not tasks["feedback"].get("cachingOptions", {}).get("enableCache")
    config = json.loads(spec["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"])
    assert config["feedback"]["project"] == "prefs" and config["feedback"]["budget"] == 32


def test_an_unreachable_host_is_one_line(cli) -> None:
    result = cli("round", "schedule", "--host", "http://127.0.0.1:9", "--cron", "0 0 3 * * 1")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert result.err.startswith("kubealign: error: KFP API at http://127.0.0.1:9:")
