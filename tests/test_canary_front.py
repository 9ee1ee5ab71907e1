"""The local canary (issue 39): the traffic split of `kubealign serve --canary` (kubealign.serving.split)
before two completions servers on 127.0.0.1, and `kubealign judge --front --act` carrying its verdict out in
a registry (sqlite) and in that front. The servers are tests/test_judge's stand-ins of vLLM's completions
route; `kubealign serve` with vLLM's real servers behind the front: tests/test_serve_vllm.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kubealign.errors import UserError
from kubealign.serving import split
from tests.faults import free_port
from tests.test_judge import Completions, judge_config
from tests.test_judge import split as split_dir  # noqa: F401 (the data-split fixture)

pytestmark = pytest.mark.faults


def test_the_canary_gets_exactly_its_share_evenly_spread() -> None:
    # p of every 100: request k is the canary's when floor((k+1)p/100) > floor(kp/100)
    assert [k for k in range(100) if split.to_canary(k, 10)] == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]
    assert [k for k in range(8) if split.to_canary(k, 50)] == [1, 3, 5, 7]
    assert [k for k in range(200) if split.to_canary(k, 1)] == [99, 199]
    assert [k for k in range(100) if not split.to_canary(k, 99)] == [0]
    assert sum(split.to_canary(k, 33) for k in range(300)) == 99
    assert [k for k in range(10) if split.to_canary(k, 25)] == [3, 7]


def completion(url: str, prompt: str = "abc") -> tuple[int, str, str]:
    """(status, the answering model's label, the answer's text or the error) of one request to url."""
    body = json.dumps({"model": "actor", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            payload = json.loads(reply.read())
            return reply.status, reply.headers[split.SERVED_HEADER], payload["choices"][0]["text"]
    except urllib.error.HTTPError as exc:
        return exc.code, "", json.loads(exc.read())["error"]


def test_the_front_splits_the_traffic_and_serves_one_version_when_told() -> None:
    """20 requests at 10 %: the 10th and the 20th are the canary's, each answer says who gave it. The route
    names both servers; one version made the whole service: every request its, the other's server is free."""
    stable, canary = Completions(lambda p: " stable"), Completions(lambda p: " canary")
    route = split.Route(split.Backend("champion", "1", stable.url), split.Backend("challenger", "2", canary.url), 10)
    port = free_port()
    front, url = split.start(port, route), f"http://127.0.0.1:{port}"
    try:
        got = [completion(url) for _ in range(20)]
        assert [k for k, (_, who, _) in enumerate(got) if who == "challenger@2"] == [9, 19]
        assert {(status, who, text) for status, who, text in got} == {
            (200, "champion@1", " stable"),
            (200, "challenger@2", " canary"),
        }
        assert split.read_route(url) == {
            "stable": {"alias": "champion", "version": "1", "url": stable.url},
            "canary": {"alias": "challenger", "version": "2", "url": canary.url},
            "percent": 10,
        }
        with pytest.raises(UserError, match="HTTP 409: version 7 is not served here .served: champion@1, challenger@2"):
            split.serve_only(url, "7")
        assert not route.changed.is_set() and route.canary is not None
        assert split.serve_only(url, "2") == "updated" and route.changed.is_set()
        assert split.serve_only(url, "2") == "unchanged"
        with pytest.raises(UserError, match=r"HTTP 409: version 1 is not served here \(served: challenger@2\)"):
            split.serve_only(url, "1")  # its server is gone: it cannot be made the service again
        assert {completion(url)[1] for _ in range(12)} == {"challenger@2"}
        assert split.read_route(url)["canary"] is None and route.served() == [route.stable]
        canary.stop()  # its server gone: the front answers 502 naming it
        status, _, error = completion(url)
        assert status == 502 and error.startswith(f"challenger@2 at {canary.url}: ")
    finally:
        front.stop()
        stable.stop()
    with pytest.raises(UserError, match=f"--front {url}: not a kubealign serve --canary front"):
        split.read_route(url)


def registry_with(uri: str, name: str, versions: int, source: Path, **aliases: str) -> None:
    """A registered model with `versions` versions and these aliases (sqlite: no server needed)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    client.create_registered_model(name)
    for _ in range(versions):
        client.create_model_version(name, source=str(source))
    for alias, version in aliases.items():
        client.set_registered_model_alias(name, alias, version)


def test_judge_front_act_rolls_back_a_worse_canary_and_a_rerun_finishes_a_promotion(
    split_dir: Path,  # noqa: F811
    tmp_path: Path,
    cli,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 2 answers curtly (the reward function gives it 0, the champion 1): `judge --front --act` rolls
    it back: challenger cleared and tagged, the front serves version 1 alone. Version 3, courteous against a
    curt champion, holds: champion moves to it, and the front's update fails once (the crash between the
    registry and the served model); the rerun moves no alias and makes version 3 the whole service."""
    from mlflow.tracking import MlflowClient

    from kubealign.models import loading
    from kubealign.serving import act
    from tests.test_faults_registry import aliases

    uri, name = f"sqlite:///{tmp_path / 'registry.db'}", "front-actor"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    registry_with(uri, name, 2, tmp_path, champion="1", challenger="2")
    # curt but not degenerate: the promotion guards bound the length ratio (issue 53)
    courteous, curt = Completions(lambda p: " Certainly! Here it is."), Completions(lambda p: " No, I cannot help.")
    sets = ["--set", f"promote.registered_model={name}", "--set", "canary.min_answers=3"]
    base = ["judge", "--config", judge_config(tmp_path), *sets, "--prompts", split_dir,
            "--tokenizer", loading.resolve("tiny-opt"), "--act"]  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    route = split.Route(split.Backend("champion", "1", courteous.url), split.Backend("challenger", "2", curt.url), 50)
    front = split.start(port, route)
    try:
        done = cli(*base, "--front", url, "--output", tmp_path / "worse")
        assert done.code == 0, done.err
        assert "judge: challenger (version 2) rolled back: win_rate 0.000 >= 0.5" in done.out
        assert f"serving: {url} updated: version 1 alone" in done.out
        assert aliases(uri, name) == {"champion": "1"}
        assert MlflowClient(uri).get_model_version(name, "2").tags[act.REJECTED_TAG] == "rejected"
        assert route.describe()["canary"] is None and route.stable.version == "1"
        assert {completion(url)[1] for _ in range(4)} == {"champion@1"}
        # judged again: nothing left to judge at that front
        done = cli(*base, "--front", url, "--output", tmp_path / "again")
        assert done.code == 2 and f"--front {url}: serves version 1 alone: no canary to judge" in done.err
    finally:
        front.stop()

    # version 3 is the challenger now; its front splits 50/50 with the curt champion version 1
    MlflowClient(uri).create_model_version(name, source=str(tmp_path))
    MlflowClient(uri).set_registered_model_alias(name, "challenger", "3")
    MlflowClient(uri).set_registered_model_alias(name, "champion", "1")
    route = split.Route(split.Backend("champion", "1", curt.url), split.Backend("challenger", "3", courteous.url), 50)
    front = split.start(port, route)
    real = act.in_local
    calls = []

    def crash_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise UserError("the front went away")
        return real(*args)

    monkeypatch.setattr(act, "in_local", crash_once)
    try:
        done = cli(*base, "--front", url, "--output", tmp_path / "better")
        assert done.code == 2 and "the front went away" in done.err
        assert aliases(uri, name) == {"champion": "3", "previous-champion": "1"}  # decided in the registry
        assert route.canary is not None  # still split
        done = cli(*base, "--front", url, "--output", tmp_path / "rerun")
        assert done.code == 0, done.err
        assert "holds online: promoted to champion" in done.out and "updated: version 3 alone" in done.out
        assert aliases(uri, name) == {"champion": "3", "previous-champion": "1"}  # the rerun moved nothing
        assert route.canary is None and route.stable.version == "3"
        assert {completion(url)[1] for _ in range(4)} == {"challenger@3"}
        # a front whose canary is not the registry's challenger is refused before any request
        MlflowClient(uri).set_registered_model_alias(name, "challenger", "2")
        route.canary, route.percent = split.Backend("challenger", "1", curt.url), 50
        done = cli(*base, "--front", url, "--output", tmp_path / "stale")
        assert done.code == 2 and f"--front {url}: its canary is version 1, challenger is 2" in done.err
        assert not (tmp_path / "stale").exists()
    finally:
        front.stop()
        courteous.stop()
        curt.stop()


def test_judge_urls_are_given_one_way(cli, tmp_path: Path) -> None:
    both = ["--champion", "http://127.0.0.1:1", "--canary", "http://127.0.0.1:2"]
    base = ["judge", "--prompts", tmp_path, "--tokenizer", tmp_path, "--output", tmp_path / "o"]
    done = cli(*base, *both, "--front", "http://127.0.0.1:3")
    assert done.code == 2 and "--front: the local split names both servers" in done.err
    done = cli(*base, "--champion", "http://127.0.0.1:1")
    assert done.code == 2 and "give --front URL (kubealign serve --canary) or both --champion" in done.err
    done = cli(*base, "--front", "http://127.0.0.1:3", "--act", "--namespace", "team-a")
    assert done.code == 2 and "--namespace: the cluster's service, --front: the local one; give one" in done.err


def pod(name: str, version: str, ready: bool = True, ip: str | None = "10.0.0.1", port: int | None = 9000) -> dict:
    ports = [{"containerPort": port}] if port else []
    return {
        "metadata": {"name": name, "labels": {"kubealign.io/model-version": version}},
        "spec": {"containers": [{"name": "queue-proxy", "ports": [{"containerPort": 1}]},
                                {"name": "kserve-container", "ports": ports}]},
        "status": {"phase": "Running", **({"podIP": ip} if ip else {}),
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }  # fmt: skip


def test_a_predictor_is_a_ready_pod_of_its_version_at_its_model_containers_port() -> None:
    from kubealign.serving.endpoints import pick

    old = pod("a-old", "1", ip="10.0.0.9")  # during a rollout the old version's pods still run
    assert pick([old, pod("b", "2", ready=False), pod("c", "2", ip=None)], "2") is None
    assert pick([old, pod("z", "2", ip="10.0.0.3"), pod("d", "2", ip="10.0.0.2")], "2") == "http://10.0.0.2:9000"
    assert pick([old, pod("d", "2", port=None)], "2") == "http://10.0.0.1:8080"  # the runtimes' port
    pending = pod("e", "2")
    pending["status"]["phase"] = "Pending"
    assert pick([pending], "2") is None and pick([old], "1") == "http://10.0.0.9:9000"


def test_no_ready_pod_of_a_predictor_is_one_line() -> None:
    from kubealign.serving.endpoints import predictor_url
    from tests.kube_standin import StandInKube

    kube = StandInKube()
    try:
        with pytest.raises(
            UserError, match="^judge: no Ready pod of team-a/actor's canary predictor serves version 3$"
        ):
            predictor_url(kube.core(), "team-a", "actor", "canary", "3")
    finally:
        kube.stop()
