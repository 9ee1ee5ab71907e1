"""The online judge's pieces (issue 39): its figures and decision by hand, and its requests against a
completions server on 127.0.0.1 with faults injected in front of it (tests/faults.FaultProxy): HTTP 500s, a
request that outlasts the timeout, garbage, a server that is not there. The server is a stand-in of vLLM's
completions route (it answers the prompt reversed) and its /metrics histogram: what is tested is how answers
and failures are counted, not a model."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kubealign.config.canary import CanaryConfig
from kubealign.config.schema import PromoteConfig
from kubealign.serving.ask import ask, latency_histogram
from kubealign.serving.verdict import (
    Answer,
    answered_pairs,
    decide,
    histogram_quantile,
    percentile,
    serving_figures,
    verdict_line,
)
from tests.support.faults import FaultProxy, free_port
from tests.support.llm_stand_in import ANSWERS, StandIn

pytestmark = pytest.mark.faults

METRICS = """# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="actor"} 9.5
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.1",model_name="actor"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="actor"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="actor"} 5.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="actor"} 6.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.1",model_name="actor"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="0.5",model_name="actor"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.0",model_name="actor"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="actor"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.1",model_name="other"} 99.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="actor"} 10.0
"""


def listing(registered: str, version: str, first: str | None = None) -> dict:
    """/v1/models as vLLM answers it for `version` of `registered` served by kubealign (kubealign.serving.identity):
    its first name (default the registered model's), then the version's model URI, one root for both."""
    root = f"/cache/served/{registered}/{version}/model"
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "root": root, "parent": None}
            for name in (first or registered, f"models:/{registered}/{version}")
        ],
    }


class Completions:
    """Answers POST /v1/completions with answer(prompt) (default: the prompt reversed); "SLOW..." prompts after
    3 s, "GARBAGE..." with a body that is not JSON; GET /metrics with METRICS; GET /v1/models with `models`
    (default: one model named as KServe's vllm runtime names it, after the InferenceService, no version)."""

    def __init__(self, answer=lambda prompt: prompt[::-1], models: dict | None = None) -> None:
        self.models = models or {"data": [{"id": "isvc-name"}]}
        served = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    return self._send(200, json.dumps(served.models).encode())
                self._send(200, METRICS.encode()) if self.path == "/metrics" else self._send(404, b"{}")

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = request["prompt"]
                if prompt.startswith("SLOW"):
                    time.sleep(3)
                if prompt.startswith("GARBAGE"):
                    return self._send(200, b"<html>upstream gone</html>")
                choice = {"text": answer(prompt), "finish_reason": "stop"}
                self._send(200, json.dumps({"choices": [choice], "model": request["model"]}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server():
    served = Completions()
    yield served
    served.stop()


def every_other(status: int):
    """A FaultProxy rule answering `status` to the 1st, 3rd, 5th ... completion request."""
    seen = [0]
    lock = threading.Lock()

    def rule(method: str, path: str, body: bytes) -> int | None:
        if method != "POST" or "/v1/completions" not in path:
            return None
        with lock:
            seen[0] += 1
            return status if seen[0] % 2 == 1 else None

    return rule


def test_percentile_is_the_nearest_rank() -> None:
    values = [0.3, 0.1, 0.4, 0.2]
    assert [percentile(values, q) for q in (25, 50, 75, 95, 100)] == [0.1, 0.2, 0.3, 0.4, 0.4]
    assert percentile([7.0], 50) == 7.0 and math.isnan(percentile([], 50))


def test_serving_figures_count_errors_by_kind_and_time_answers_only() -> None:
    answers = [
        Answer(0, "a", 0.2),
        Answer(1, None, 9.0, "HTTP 500"),
        Answer(2, "b", 0.4),
        Answer(3, None, 30.0, "timeout"),
        Answer(4, None, 0.1, "garbage: b'<html>'"),
        Answer(5, None, 0.0, "HTTP 500"),
        Answer(6, "c", 0.1),
    ]
    figures = serving_figures(answers)
    assert figures["requests"] == 7 and figures["errors"] == 4 and figures["error_rate"] == 4 / 7
    assert figures["errors/HTTP 500"] == 2 and figures["errors/timeout"] == 1 and figures["errors/garbage"] == 1
    assert figures["latency_p50_s"] == 0.2 and figures["latency_p95_s"] == 0.4  # 9 s and 30 s were errors
    assert answered_pairs(
        answers, [Answer(0, "x", 1), Answer(2, None, 1, "timeout"), Answer(6, "y", 1), Answer(1, "z", 1)]
    ) == [0, 6]


def test_histogram_quantile_interpolates_as_prometheus_does() -> None:
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / (6 - 2))  # rank 5 of 10
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.1 * 1 / 2)  # the first bucket starts at 0
    assert histogram_quantile(buckets, 0.8) == pytest.approx(1.0)  # rank 8 ends the third bucket
    assert histogram_quantile(buckets, 0.95) == 1.0  # in +Inf: the highest finite bound
    assert math.isnan(histogram_quantile([], 0.5)) and math.isnan(histogram_quantile([(1.0, 0.0)], 0.5))


def test_the_latency_histogram_is_read_from_vllms_metrics_for_the_served_model() -> None:
    # two engines' series of `actor` summed; `other` and the _sum / _count lines left out
    assert latency_histogram(METRICS, "actor") == [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert latency_histogram(METRICS, "nobody") == [] and latency_histogram("", "actor") == []


def online(win: float, gain: float) -> dict[str, float]:
    """The online figures, the degeneration ones the same for both models (no held-out log-likelihood: the
    judge does not measure one)."""
    same = {"repetition_rate": 0.0, "distinct_2": 0.5, "empty_rate": 0.0, "unfinished_rate": 0.0, "length_mean": 6.0}
    return {
        "win_rate": win,
        "win_rate_lower_bound": win - 0.1,
        "reward_gain": gain,
        "kl_to_baseline": math.nan,
        "candidate_reward_mean": 1.0,
        **{f"{who}_{k}": v for k, v in same.items() for who in ("baseline", "candidate")},
        "heldout_win_rate": win,
        "reward_agreement": 1.0,
    }


def test_the_decision_needs_enough_answers_few_errors_and_the_gate() -> None:
    promote, cfg = PromoteConfig(), CanaryConfig(min_answers=8, max_error_rate=0.1, max_latency_p95_s=2.0)
    quiet = {"error_rate": 0.0, "latency_p95_s": 0.5}
    ok, lines = decide(online(0.7, 0.3), 8, quiet, promote, cfg)
    unmeasured = "unchecked: capability: no held-out log-likelihood measured"
    assert ok and all(line.startswith("pass: ") for line in lines if line != unmeasured) and unmeasured in lines
    # a canary whose answers degenerate is refused online by the guards, whatever its win-rate
    ok, lines = decide({**online(0.9, 0.5), "candidate_distinct_2": 0.125}, 8, quiet, promote, cfg)
    assert (
        not ok
        and "FAIL: degeneration: distinct-2 ratio: needs >= 0.5, got 0.250 (baseline 0.500, candidate 0.125)" in lines
    )
    # one the held-out reward model does not prefer is refused online too (issue 53's independent scorer)
    ok, lines = decide({**online(0.9, 0.5), "heldout_win_rate": 0.25}, 8, quiet, promote, cfg)
    assert not ok and [line for line in lines if line.startswith("FAIL")] == [
        "FAIL: held-out reward model: win-rate: needs >= 0.5, got 0.250 (agrees with the training reward model on 100% of the prompts)"
    ]
    ok, lines = decide(online(0.7, 0.3), 7, quiet, promote, cfg)  # one pair short: never promoted
    assert not ok and lines[0] == "FAIL: prompts answered by both: needs >= canary.min_answers 8, got 7"
    assert lines[-1] == "FAIL: the gate: not applied on too few answers"
    ok, lines = decide(online(0.7, 0.3), 8, {"error_rate": 0.125, "latency_p95_s": 0.5}, promote, cfg)
    assert not ok and "FAIL: canary error_rate: needs <= 0.1, got 0.125" in lines
    ok, lines = decide(online(0.7, 0.3), 8, {"error_rate": 0.1, "latency_p95_s": 2.5}, promote, cfg)
    assert (
        not ok
        and "FAIL: canary latency_p95: needs <= 2.0 s, got 2.500 s" in lines
        and "pass: canary error_rate: needs <= 0.1, got 0.100" in lines
    )
    ok, lines = decide(online(0.4, -0.1), 8, quiet, promote, cfg)  # the gate's own rule on the online numbers
    assert (
        not ok
        and "FAIL: win_rate: needs >= 0.5, got 0.400" in lines
        and "FAIL: reward_gain: needs >= 0.0, got -0.100" in lines
    )
    ok, lines = decide(online(0.7, 0.3), 8, quiet, PromoteConfig(max_kl=0.5), cfg)  # KL is not measured online
    assert ok and lines[-1].startswith("unchecked: promote.max_kl 0.5")
    assert verdict_line(False, lines[:1] + ["FAIL: canary error_rate: needs <= 0.05, got 0.5"], "challenger", "7") == (
        "judge: challenger (version 7) rolled back: canary error_rate: needs <= 0.05, got 0.5"
    )
    assert verdict_line(True, lines, "challenger", "7").endswith("holds online: promoted to champion")


def test_people_s_win_rate_is_one_more_check_when_asked() -> None:
    from kubealign.serving.verdict import HumanFeedback

    promote, quiet = PromoteConfig(), {"error_rate": 0.0, "latency_p95_s": 0.5}
    off = CanaryConfig(min_answers=8)
    assert decide(online(0.7, 0.3), 8, quiet, promote, off, None)[0]  # not asked: no feedback needed
    asked = CanaryConfig(min_answers=8, min_human_win_rate=0.6)
    ok, lines = decide(online(0.7, 0.3), 8, quiet, promote, asked, None)
    assert (
        not ok and "FAIL: people's win-rate: needs >= canary.min_human_win_rate 0.6, got no decided feedback" in lines
    )
    ok, lines = decide(online(0.7, 0.3), 8, quiet, promote, asked, HumanFeedback(0.5, 10, "feedback run r1"))
    assert not ok and (
        "FAIL: people's win-rate over 10 tasks: needs >= canary.min_human_win_rate 0.6, got 0.500 (feedback run r1)"
        in lines
    )
    ok, lines = decide(online(0.7, 0.3), 8, quiet, promote, asked, HumanFeedback(0.6, 10, "feedback run r2"))
    assert (
        ok
        and "pass: people's win-rate over 10 tasks: needs >= canary.min_human_win_rate 0.6, got 0.600 (feedback run r2)"
        in lines
    )
    assert not decide(online(0.7, 0.3), 8, quiet, promote, asked, HumanFeedback(0.9, 0, "feedback run r3"))[0]


LLM_JUDGED = {
    "llm_judge_win_rate": 0.5,
    "llm_judge_loss_rate": 0.25,
    "llm_judge_tie_rate": 0.25,
    "llm_judge_unparsed": 0.0,
    "llm_judge_position_bias": 0.625,
}


def test_the_llm_judges_bar_online_is_the_offline_one() -> None:
    """promote.guards.min_llm_judge_win_rate on the online figures: "min_win_rate" is promote.min_win_rate, the bar
    the online win-rate meets (as the held-out reward model's); met at the figure, missed just below it."""
    promote, cfg = PromoteConfig(), CanaryConfig(min_answers=8)
    quiet = {"error_rate": 0.0, "latency_p95_s": 0.5}
    line = "llm judge: win-rate in both orders: needs >= 0.5, got 0.500 (position bias 0.62)"
    ok, lines = decide({**online(0.7, 0.3), **LLM_JUDGED}, 8, quiet, promote, cfg)
    assert ok and f"pass: {line}" in lines
    above = PromoteConfig(min_win_rate=0.5 + 2**-20)  # 0.7 still meets it: only the LLM judge's 0.5 does not
    ok, lines = decide({**online(0.7, 0.3), **LLM_JUDGED}, 8, quiet, above, cfg)
    assert not ok and [line for line in lines if line.startswith("FAIL")] == [
        f"FAIL: llm judge: win-rate in both orders: needs >= {0.5 + 2**-20}, got 0.500 (position bias 0.62)"
    ]
    assert verdict_line(ok, lines, "challenger", "3") == (
        f"judge: challenger (version 3) rolled back: llm judge: win-rate in both orders: needs >= {0.5 + 2**-20}, "
        "got 0.500 (position bias 0.62)"
    )
    guards = {"min_llm_judge_win_rate": 0.5}  # a number of its own, at and just below the figure
    ok, lines = decide({**online(0.7, 0.3), **LLM_JUDGED}, 8, quiet, PromoteConfig(guards=guards), cfg)
    assert ok and f"pass: {line}" in lines
    guards = {"min_llm_judge_win_rate": 0.5 + 2**-20}
    ok, lines = decide({**online(0.7, 0.3), **LLM_JUDGED}, 8, quiet, PromoteConfig(guards=guards), cfg)
    assert not ok
    off = PromoteConfig(guards={"min_llm_judge_win_rate": None})
    ok, lines = decide({**online(0.7, 0.3), **LLM_JUDGED, "llm_judge_win_rate": 0.0}, 8, quiet, off, cfg)
    assert ok and not any("llm judge" in line for line in lines)
    ok, lines = decide(online(0.7, 0.3), 8, quiet, promote, cfg)  # no LLM judge: no line, nothing missing
    assert ok and not any("llm judge" in line for line in lines)


def test_the_llm_judge_online_asks_both_orders_of_the_pairs_both_answered(monkeypatch) -> None:
    """Served answers of different lengths, one pair as long, a prompt only the canary answered; a judge that
    prefers the longer answer (the first slot when both are as long). Figures by hand."""
    from kubealign.config import KubealignConfig
    from kubealign.stages.judge import llm_judge_verdicts

    prompts = ["p0", "p1", "p2", "p3", "p4"]
    champion = ["ab", "abcdef", "abc", "xy", None]
    canary = ["abcd", "a", "abcde", "zw", "the longest answer of all"]
    answers = {
        "champion": [Answer(i, t, 0.1, None if t else "timeout") for i, t in enumerate(champion)],
        "canary": [Answer(i, t, 0.1) for i, t in enumerate(canary)],
    }
    pairs = answered_pairs(answers["champion"], answers["canary"])
    assert pairs == [0, 1, 2, 3]
    # no URL: nothing asked, no figures, no verdicts
    monkeypatch.setattr("kubealign.answers.llm_judge.ask", lambda *a: pytest.fail("the LLM judge was asked"))
    assert llm_judge_verdicts(KubealignConfig(), prompts, answers, pairs) == ({}, {})
    monkeypatch.undo()
    judge = StandIn()
    try:
        config = KubealignConfig(evaluate={"llm_judge": {"url": judge.url, "timeout_s": 10}})
        figures, verdicts = llm_judge_verdicts(config, prompts, answers, pairs)
    finally:
        judge.stop()
    # p0: canary longer, preferred in both orders; p1: the champion; p2: the canary; p3 as long: "1" both times
    assert verdicts == {0: "canary", 1: "champion", 2: "canary", 3: "tie"}
    # slots named (canary first, champion first): p0 1,2; p1 2,1; p2 1,2; p3 1,1 -> the first 5 times of 8
    assert figures == LLM_JUDGED
    asked = sorted(tuple(ANSWERS.search(r["prompt"]).groups()) for r, _ in judge.seen)
    assert asked == sorted(
        [
            ("abcd", "ab"),
            ("ab", "abcd"),
            ("a", "abcdef"),
            ("abcdef", "a"),
            ("abcde", "abc"),
            ("abc", "abcde"),
            ("zw", "xy"),
            ("xy", "zw"),
        ]
    )


def test_every_kind_of_failed_request_is_counted_in_prompt_order(server: Completions) -> None:
    cfg = CanaryConfig(request_timeout_s=1.0, concurrency=3)
    proxy = FaultProxy(server.url).start()
    proxy.rules.append(every_other(500))
    try:
        prompts = ["ab", "cd", "ef", "gh", "SLOW 1", "GARBAGE 1"]
        answers = ask(proxy.url, "actor", prompts, cfg)
    finally:
        proxy.stop()
    assert [a.prompt for a in answers] == list(range(6))
    by_kind = [a.error or a.text for a in answers]
    # the proxy fails 3 of the 6 requests (whichever came 1st, 3rd, 5th); the others get their own answer
    assert sum(a.error == "HTTP 500" for a in answers) == 3
    expected = {0: "ba", 1: "dc", 2: "fe", 3: "hg", 4: "timeout", 5: "garbage: b'<html>upstream gone</html>'"}
    assert all(kind in ("HTTP 500", expected[i]) for i, kind in enumerate(by_kind)), by_kind
    direct = ask(server.url, "actor", prompts, cfg)
    assert [a.error or a.text for a in direct] == [expected[i] for i in range(6)]
    assert direct[4].latency_s >= 1.0 and all(a.latency_s < 1.0 for a in direct[:4])
    nobody = ask(f"http://127.0.0.1:{free_port()}", "actor", prompts[:2], cfg)
    assert [a.error for a in nobody] == ["refused", "refused"]


def test_a_canary_failing_half_its_requests_is_rolled_back_in_one_line(server: Completions) -> None:
    cfg = CanaryConfig(min_answers=4, max_error_rate=0.05, concurrency=2)
    proxy = FaultProxy(server.url).start()
    proxy.rules.append(every_other(500))
    try:
        prompts = [f"prompt {i}" for i in range(8)]
        champion, canary = ask(server.url, "actor", prompts, cfg), ask(proxy.url, "actor", prompts, cfg)
    finally:
        proxy.stop()
    figures = serving_figures(canary)
    assert figures["error_rate"] == 0.5 and figures["errors/HTTP 500"] == 4
    pairs = answered_pairs(champion, canary)
    assert len(pairs) == 4  # the canary's answered half, all of which the champion answered
    ok, lines = decide(online(0.7, 0.3), len(pairs), figures, PromoteConfig(), cfg)
    assert not ok
    assert (
        verdict_line(ok, lines, "challenger", "2")
        == "judge: challenger (version 2) rolled back: canary error_rate: needs <= 0.05, got 0.500"
    )


COURTESY = """
def courteous(prompts, completions, **columns):
    return [1.0 if c.startswith(" Certainly") else 0.0 for c in completions]
"""


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("judge") / "split"
    assert main(["data-split", "--output", str(out), "--set", "tracking.enabled=false"]) == 0
    return out


def judge_config(tmp_path: Path, **canary: object) -> Path:
    """A config whose reward is the function above alone (no reward model), with these canary settings."""
    import yaml

    (tmp_path / "fns.py").write_text(COURTESY, encoding="utf-8")
    doc = {
        "rewards": {"model_weight": 0.0, "functions": [{"path": "fns.py:courteous"}]},
        "canary": {"prompts": 6, "min_answers": 4, **canary},
        "tracking": {"enabled": False},
    }
    (tmp_path / "judge.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return tmp_path / "judge.yaml"


def test_the_judge_promotes_a_canary_that_answers_better_and_says_why_not_otherwise(split: Path, tmp_path: Path, cli):
    """The champion answers curtly, the canary courteously: the reward function prefers every canary answer,
    the online win-rate is 1 over the 6 prompts and the canary is promoted. Swapped, it loses every prompt and is
    rolled back by the gate's own rule; through a proxy failing half its requests, by its error rate."""
    from kubealign.models import loading

    curt, courteous = Completions(lambda p: " No, I cannot help."), Completions(lambda p: " Certainly! Here it is.")
    tokenizer = loading.resolve("tiny-opt")
    try:
        config = judge_config(tmp_path)
        base = ["judge", "--config", str(config), "--prompts", split, "--tokenizer", tokenizer]
        store = f"sqlite:///{tmp_path / 'mlflow.db'}"
        tracked = ["--set", "tracking.enabled=true", "--set", f"tracking.uri={store}"]
        done = cli(*base, "--champion", curt.url, "--canary", courteous.url, "--output", tmp_path / "good", *tracked)
        assert done.code == 0, done.err
        result = json.loads((tmp_path / "good" / "result.json").read_text())
        m = result["metrics"]
        assert result["promoted"] and m["prompts"] == 6 and m["win_rate"] == 1.0 and m["reward_gain"] == 1.0
        assert m["baseline_reward_mean"] == 0.0 and m["candidate_reward_mean"] == 1.0
        assert m["fn/courteous/candidate"] == 1.0 and m["champion/requests"] == m["canary/requests"] == 6
        assert m["canary/error_rate"] == 0.0 and m["canary/latency_p95_s"] > 0
        assert "canary/server_latency_p50_s" not in m  # the stand-in's /metrics has no series for kubealign-actor
        assert "judge: challenger (version ?) holds online: promoted to champion" in done.out
        # without --act no registry is read: the served versions are said to be unchecked, not failed
        unchecked = "unchecked: served versions: judged without --act, the registry is not read"
        assert f"judge: {unchecked}\n" in done.out
        answers = json.loads((tmp_path / "good" / "answers.json").read_text())
        assert len(answers) == 6 and answers[0]["canary"]["text"] == " Certainly! Here it is."
        assert "llm_judge" not in answers[0] and not any("llm judge" in c for c in result["checks"])  # none set
        # each pair's scores as [champion's, canary's] (feedback push --from-judge weighs the pairs by them), and
        # the versions served (without --act or a front none is known: '?', which that push refuses)
        assert [a["scores"] for a in answers] == [{"reward": [0.0, 1.0]}] * 6
        assert (
            result["versions"] == {"champion": "?", "canary": "?"} and result["registered_model"] == "kubealign-actor"
        )
        result_good_run = result["judge_run"]
        assert not any(k.startswith("llm_judge") for k in m)
        assert "| win_rate | 1 |" in (tmp_path / "good" / "judge.md").read_text()
        assert f"- {unchecked}" in (tmp_path / "good" / "judge.md").read_text() and result["checks"][0] == unchecked
        assert (tmp_path / "good" / "judge.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        from mlflow.tracking import MlflowClient

        client = MlflowClient(store)
        [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.data.metrics["win_rate"] == 1.0 and run.data.metrics["canary/error_rate"] == 0.0
        assert result_good_run == run.info.run_id  # the judge's MLflow run, named on the tasks pushed from it
        assert {a.path for a in client.list_artifacts(run.info.run_id, "judge")} >= {
            "judge/judge.png",
            "judge/judge.md",
        }

        done = cli(*base, "--champion", courteous.url, "--canary", curt.url, "--output", tmp_path / "bad")
        result = json.loads((tmp_path / "bad" / "result.json").read_text())
        assert done.code == 0 and not result["promoted"] and result["metrics"]["win_rate"] == 0.0
        # served as `actor`: each server's own latency from its /metrics histogram (METRICS: p50 0.4 s, p95 in +Inf)
        done = cli(
            *base,
            "--champion",
            curt.url,
            "--canary",
            courteous.url,
            "--output",
            tmp_path / "named",
            "--served-name",
            "actor",
        )
        m = json.loads((tmp_path / "named" / "result.json").read_text())["metrics"]
        assert m["canary/server_latency_p50_s"] == pytest.approx(0.4) and m["champion/server_latency_p95_s"] == 1.0
        assert "| server_latency_p50_s | 0.4 | 0.4 |" in (tmp_path / "named" / "judge.md").read_text()
        assert result["verdict"] == "judge: challenger (version ?) rolled back: win_rate: needs >= 0.5, got 0.000"

        proxy = FaultProxy(courteous.url).start()
        proxy.rules.append(every_other(500))
        try:
            done = cli(
                *base,
                "--champion",
                curt.url,
                "--canary",
                proxy.url,
                "--output",
                tmp_path / "flaky",
                "--set",
                "canary.min_answers=3",
            )
        finally:
            proxy.stop()
        result = json.loads((tmp_path / "flaky" / "result.json").read_text())
        assert not result["promoted"] and result["metrics"]["canary/errors/HTTP 500"] == 3
        assert result["verdict"].endswith("rolled back: canary error_rate: needs <= 0.05, got 0.500")
        assert result["metrics"]["win_rate"] == 1.0  # what it did answer was better: the errors decide
        # a canary that never answers: nothing to score, never promoted, the first reason is the count
        done = cli(
            *base, "--champion", curt.url, "--canary", f"http://127.0.0.1:{free_port()}", "--output", tmp_path / "down"
        )
        result = json.loads((tmp_path / "down" / "result.json").read_text())
        assert result["verdict"].endswith("rolled back: prompts answered by both: needs >= canary.min_answers 4, got 0")
        assert result["metrics"]["canary/errors/refused"] == 6
        # a canary that found the reward function's exploit: it wins every prompt with one degenerate answer,
        # and the guards the online judge applies roll it back (issue 53)
        hacked = Completions(lambda p: " Certainly to to to to to to to to to to.")
        try:
            done = cli(*base, "--champion", curt.url, "--canary", hacked.url, "--output", tmp_path / "hacked")
        finally:
            hacked.stop()
        result = json.loads((tmp_path / "hacked" / "result.json").read_text())
        assert done.code == 0 and not result["promoted"] and result["metrics"]["win_rate"] == 1.0
        verdict = result["verdict"]  # the rate itself depends on the tokenizer's split; test_guards has it by hand
        assert verdict.startswith(
            "judge: challenger (version ?) rolled back: degeneration: repeated-bigram rate rise: needs <= 0.2, got "
        )
        assert verdict.endswith(")") and result["metrics"]["candidate_repetition_rate"] > 0.2
    finally:
        curt.stop()
        courteous.stop()


def test_a_canary_the_reward_likes_and_the_llm_judge_does_not_is_rolled_back(split: Path, tmp_path: Path, cli):
    """The reward function prefers every courteous canary answer (online win-rate 1); the LLM judge, which
    prefers the longer answer, prefers the champion's longer curt one in both orders on every prompt: refused
    online with the LLM judge's line alone, each prompt's verdict in answers.json and the line in judge.md."""
    from kubealign.models import loading

    curt = Completions(lambda p: " No, I cannot help with that, sorry.")
    courteous = Completions(lambda p: " Certainly! Here it is.")
    judge = StandIn()
    try:
        tokenizer = loading.resolve("tiny-opt")
        base = ["judge", "--config", judge_config(tmp_path), "--prompts", split, "--tokenizer", tokenizer]
        done = cli(
            *base,
            "--champion",
            curt.url,
            "--canary",
            courteous.url,
            "--output",
            tmp_path / "judged",
            "--set",
            f"evaluate.llm_judge.url={judge.url}",
            "--set",
            "evaluate.llm_judge.timeout_s=10",
        )
        down = f"http://127.0.0.1:{free_port()}"  # a judge that answers nothing: one line, no verdict written
        gone = cli(
            *base,
            "--champion",
            curt.url,
            "--canary",
            courteous.url,
            "--output",
            tmp_path / "gone",
            "--set",
            f"evaluate.llm_judge.url={down}",
        )
    finally:
        curt.stop()
        courteous.stop()
        judge.stop()
    assert done.code == 0, done.err
    result = json.loads((tmp_path / "judged" / "result.json").read_text())
    m = result["metrics"]
    assert m["win_rate"] == 1.0 and m["reward_gain"] == 1.0  # the reward function's view
    assert {k: m[k] for k in LLM_JUDGED} == {
        "llm_judge_win_rate": 0.0,
        "llm_judge_loss_rate": 1.0,
        "llm_judge_tie_rate": 0.0,
        "llm_judge_unparsed": 0.0,
        "llm_judge_position_bias": 0.5,
    }
    line = "llm judge: win-rate in both orders: needs >= 0.5, got 0.000 (position bias 0.50)"
    assert not result["promoted"] and [c for c in result["checks"] if c.startswith("FAIL")] == [f"FAIL: {line}"]
    assert result["verdict"] == f"judge: challenger (version ?) rolled back: {line}"
    assert len(judge.seen) == 2 * 6  # both orders of the 6 prompts
    answers = json.loads((tmp_path / "judged" / "answers.json").read_text())
    assert [row["llm_judge"] for row in answers] == ["champion"] * 6
    report = (tmp_path / "judged" / "judge.md").read_text()
    assert f"- FAIL: {line}" in report and "| llm_judge_win_rate | 0 |" in report
    assert gone.code != 0 and f"evaluate.llm_judge: no request to {down}/v1/completions was answered" in gone.err
    assert not (tmp_path / "gone").exists()
