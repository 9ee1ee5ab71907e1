"""Contract test of `kubealign submit`: no Kubeflow cluster runs here, so a local HTTP server answers
the KFP v2beta1 REST endpoints kfp.Client calls (experiments, runs) and records what arrived.
The test asserts the request kfp.Client built from our compiled package: the pipeline spec, the
parameters, the caching flag, the run name and the experiment."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytestmark = pytest.mark.kfp


class FakeKfpApi(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, dict]] = []

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _reply(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.calls.append(("GET", self.path, {}))
        if self.path.startswith("/apis/v2beta1/experiments"):
            self._reply(200, {"experiments": [], "total_size": 0})  # none yet: the client creates one
        elif self.path.startswith("/apis/v2beta1/pipelines?"):
            self._reply(200, {"pipelines": [], "total_size": 0})  # no pipeline of that name yet
        elif self.path.startswith("/apis/v2beta1/healthz"):
            self._reply(200, {"multi_user": False})
        else:
            self._reply(404, {"error": f"not in the fake: {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        multipart = self.headers.get("Content-Type", "").startswith("multipart/form-data")
        body = {"multipart": raw} if multipart else json.loads(raw or b"{}")
        self.calls.append(("POST", self.path, body))
        if self.path.startswith("/apis/v2beta1/pipelines/upload_version"):
            self._reply(200, {"pipeline_id": "p-1", "pipeline_version_id": "v-1", "display_name": "v"})
        elif self.path.startswith("/apis/v2beta1/pipelines/upload"):
            self._reply(200, {"pipeline_id": "p-1", "display_name": "kubealign-rlhf"})
        elif self.path == "/apis/v2beta1/experiments":
            self._reply(200, {"experiment_id": "exp-7", "display_name": body["display_name"]})
        elif self.path == "/apis/v2beta1/runs":
            self._reply(200, {"run_id": "run-42", "display_name": body["display_name"], "state": "PENDING"})
        else:
            self._reply(404, {"error": f"not in the fake: {self.path}"})


@pytest.fixture
def kfp_api() -> Iterator[tuple[str, list]]:
    FakeKfpApi.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKfpApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", FakeKfpApi.calls
    server.shutdown()


def submitted_run(calls: list) -> dict:
    runs = [body for method, path, body in calls if (method, path) == ("POST", "/apis/v2beta1/runs")]
    assert len(runs) == 1, calls
    return runs[0]


def test_submit_sends_the_pipeline_parameters_and_caching(cli, kfp_api) -> None:
    host, calls = kfp_api
    result = cli(
        "submit",
        "--host",
        host,
        "--experiment",
        "rlhf-team",
        "--run-name",
        "nightly-7",
        "--set",
        "ppo.num_iterations=12",
        "--set",
        "kubernetes.ppo_gpus=4",
    )
    assert result.code == 0, result.err
    assert f"{host}/#/runs/details/run-42" in result.out
    experiment = [b for m, p, b in calls if (m, p) == ("POST", "/apis/v2beta1/experiments")]
    assert [e["display_name"] for e in experiment] == ["rlhf-team"]
    run = submitted_run(calls)
    assert run["display_name"] == "nightly-7" and run["experiment_id"] == "exp-7"
    # kfp.Client sends the IR's two documents under pipeline_spec: the DAG and the Kubernetes platform config
    spec, platform = run["pipeline_spec"]["pipeline_spec"], run["pipeline_spec"]["platform_spec"]
    assert spec["pipelineInfo"]["name"] == "kubealign-rlhf"
    # ppo and dpo sit in the condition branches of the algorithm route (tests/pipelines/test_pipeline_compile.py)
    assert set(spec["root"]["dag"]["tasks"]) == {
        "data-split",
        "sft",
        "reward",
        "condition-branches-1",
        "evaluate",
        "promote",
    }
    assert spec["root"]["inputDefinitions"]["parameters"]["algorithm"]["defaultValue"] == "ppo"
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["ppo_num_iterations"]["defaultValue"] == 12
    config = json.loads(params["config_json"]["defaultValue"])
    assert config["ppo"]["num_iterations"] == 12 and config["kubernetes"]["ppo_gpus"] == 4
    ppo_exec = spec["deploymentSpec"]["executors"]["exec-ppo"]["container"]
    assert ppo_exec["resources"]["accelerator"]["resourceCount"] == "4"
    assert "exec-ppo" in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["sft"]["cachingOptions"].get("enableCache") is True  # compile-time default kept


def test_no_cache_turns_caching_off_for_every_task(cli, kfp_api) -> None:
    host, calls = kfp_api
    assert cli("submit", "--host", host, "--no-cache").code == 0
    tasks = submitted_run(calls)["pipeline_spec"]["pipeline_spec"]["root"]["dag"]["tasks"]
    assert {name: t.get("cachingOptions", {}).get("enableCache", False) for name, t in tasks.items()} == dict.fromkeys(
        tasks, False
    )


def test_upload_creates_the_pipeline_and_a_version(cli, kfp_api) -> None:
    host, calls = kfp_api
    result = cli("upload", "--host", host, "--pipeline-name", "rlhf-prod", "--set", "ppo.num_iterations=7")
    assert result.code == 0, result.err
    posts = [(path, body) for method, path, body in calls if method == "POST"]
    assert [p.split("?")[0] for p, _ in posts] == [
        "/apis/v2beta1/pipelines/upload",
        "/apis/v2beta1/pipelines/upload_version",
    ]
    assert "name=rlhf-prod" in posts[0][0] and "pipelineid=p-1" in posts[1][0]
    package = posts[1][1]["multipart"]  # the compiled IR YAML, as a file upload
    assert b"pipelineInfo" in package and b"ppo_num_iterations" in package and b"defaultValue: 7" in package
    assert "pipeline id p-1" in result.out


def test_unreachable_host_is_one_line(cli) -> None:
    result = cli("submit", "--host", "http://127.0.0.1:9")
    assert result.code == 2
    assert result.err.startswith("kubealign: error: KFP API at http://127.0.0.1:9:")
    assert len(result.err.strip().splitlines()) == 1
