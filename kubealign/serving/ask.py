"""The online judge's requests: held-out prompts to a served model's OpenAI-compatible completions route
(vLLM's, as `kubealign serve` and KServe's vllm runtime run it), and its latency histogram from /metrics.
The LLM judge (kubealign.answers.llm_judge) sends its pairs to its server through `complete` too.

Every request ends as a kubealign.serving.verdict.Answer: the completion's text, or one line saying why not
(HTTP status, timeout, refused, garbage). Nothing raises for a bad answer: the judge counts them.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from kubealign.config.canary import CanaryConfig
from kubealign.serving.verdict import Answer

LATENCY_METRIC = "vllm:e2e_request_latency_seconds"  # vLLM's histogram of a request's whole time


def ask(base_url: str, model: str, prompts: list[str], cfg: CanaryConfig) -> list[Answer]:
    """Every prompt to BASE_URL/v1/completions (greedy, canary.max_new_tokens), canary.concurrency in flight;
    the answers in prompt order."""
    return complete(base_url, model, prompts, Limits(cfg.max_new_tokens, cfg.request_timeout_s, cfg.concurrency))


class Limits(NamedTuple):
    """One batch of completions: max_tokens each, seconds before a request is an error, requests in flight."""

    max_tokens: int
    timeout_s: float
    concurrency: int


def complete(base_url: str, model: str, prompts: list[str], limits: Limits, api_key: str | None = None) -> list[Answer]:
    """Every prompt to BASE_URL/v1/completions at temperature 0, limits.concurrency in flight, with
    'Authorization: Bearer API_KEY' when one is given; the answers in prompt order."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    with ThreadPoolExecutor(max_workers=limits.concurrency) as pool:
        return list(pool.map(lambda i: _one(base_url, model, i, prompts[i], limits, headers), range(len(prompts))))


def _one(base_url: str, model: str, index: int, prompt: str, limits: Limits, headers: dict[str, str]) -> Answer:
    payload = {"model": model, "prompt": prompt, "max_tokens": limits.max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/v1/completions", data=json.dumps(payload).encode(), headers=headers
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=limits.timeout_s) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        return Answer(index, None, time.monotonic() - started, f"HTTP {exc.code}")
    except TimeoutError:
        return Answer(index, None, time.monotonic() - started, "timeout")
    except urllib.error.URLError as exc:
        kind = "timeout" if isinstance(exc.reason, TimeoutError) else "refused"
        return Answer(index, None, time.monotonic() - started, kind)
    except (ConnectionError, http.client.HTTPException) as exc:  # closed mid-answer
        return Answer(index, None, time.monotonic() - started, f"broken: {type(exc).__name__}")
    latency = time.monotonic() - started
    try:
        choice = json.loads(body)["choices"][0]
        text = choice["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Answer(index, None, latency, f"garbage: {body[:60]!r}")
    if not isinstance(text, str):
        return Answer(index, None, latency, f"garbage: text is {type(text).__name__}")
    return Answer(index, text, latency, finished=choice.get("finish_reason") != "length")


def latency_histogram(metrics_text: str, model: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of the served model's request-latency histogram in a Prometheus text
    exposition (vLLM's /metrics), summed over its label sets; empty when the server exposes none."""
    buckets: dict[float, float] = {}
    pattern = rf"^{re.escape(LATENCY_METRIC)}_bucket\{{(?P<labels>[^}}]*)\}} (?P<count>\S+)$"
    for match in re.finditer(pattern, metrics_text, flags=re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if labels.get("model_name", model) != model or "le" not in labels:
            continue
        le = float(labels["le"])  # "+Inf" parses as inf
        buckets[le] = buckets.get(le, 0.0) + float(match.group("count"))
    return sorted(buckets.items())


def scrape(base_url: str, timeout_s: float = 10.0) -> str:
    """BASE_URL/metrics as text ('' when it does not answer: the judge then has the client's latencies only)."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as reply:
            return reply.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return ""


def models(base_url: str, timeout_s: float = 30.0) -> Any:
    """BASE_URL/v1/models as JSON (kubealign.serving.identity reads which version it serves); one line when the
    server does not answer with JSON."""
    from kubealign.errors import UserError

    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise UserError(f"judge: {base_url}/v1/models does not name a served model ({exc})") from None


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The model name a server answers to (the first of BASE_URL/v1/models): KServe's runtimes name it after
    the InferenceService, not after the registered model. One line when the server does not say."""
    from kubealign.errors import UserError

    listed = models(base_url, timeout_s)
    try:
        return str(listed["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as exc:
        raise UserError(f"judge: {base_url}/v1/models does not name a served model ({exc})") from None
