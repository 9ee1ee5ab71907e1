"""`kubealign serve` for real (issue 38): a registry alias served by vLLM's OpenAI-compatible server on CPU.

Its own tier (`make test-serve`, marker vllm): the first use builds vLLM's venv (about 2.5 minutes here) and
every server start takes 40-100 s on 2 cores. The registry is a sqlite store where `kubealign promote` made
the model champion, as `make demo` leaves one; `kubealign serve` runs as a person runs it, as a process of
its own. Served = evaluated: with temperature 0 the served tokens equal transformers' greedy `generate` of the
same directory, for the completion and the chat route, on the demo's OPT and on a LLaMA-architecture model.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.faults.test_faults_registry import evaluation
from tests.serving.test_serving import PROMPTS
from tests.support.faults import free_port
from tests.support.stores import process_env

pytestmark = pytest.mark.vllm

KUBEALIGN = Path(sys.executable).with_name("kubealign")
READY_LIMIT_S = 900  # the venv's first build and a server start on a busy machine
NEW_TOKENS = 24


def post(port: int, route: str, payload: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/{route}",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def greedy(model_dir: Path, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy generate of the directory: the new tokens up to (without) EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    new = out[0, len(prompt_ids) :].tolist()
    return new[: new.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in new else new


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Path]]:
    """A sqlite registry with tiny-opt champion of `opt-actor` and tiny-llama champion of `llama-actor`."""
    from kubealign.models import loading

    root = tmp_path_factory.mktemp("served")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    models = {"opt-actor": Path(loading.resolve("tiny-opt")), "llama-actor": Path(loading.resolve("tiny-llama"))}
    for name, model in models.items():
        argv = [
            str(KUBEALIGN),
            "promote",
            "--evaluation",
            str(evaluation(root, name, 0.7, 0.3, 1.0)),
            "--model-dir",
            str(model),
            "--output",
            str(root / f"p-{name}"),
            "--set",
            f"promote.registered_model={name}",
        ]
        done = subprocess.run(
            argv, env=process_env({"MLFLOW_TRACKING_URI": uri}), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return uri, models


def start(uri: str, name: str, port: int, alias: str = "champion") -> tuple[subprocess.Popen, str]:
    """`kubealign serve` until its ready line; (process, what it printed)."""
    argv = [str(KUBEALIGN), "serve", "--tracking-uri", uri, "--model", name, "--port", str(port), "--alias", alias]
    proc = subprocess.Popen(argv, env=process_env({}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    printed, deadline = "", time.monotonic() + READY_LIMIT_S
    while f"serve: {name}@" not in printed:  # the ready line (the venv's first build prints two before it)
        assert proc.poll() is None, printed[-3000:]
        assert time.monotonic() < deadline, printed[-3000:]
        if select.select([proc.stdout], [], [], 5)[0]:
            printed += proc.stdout.readline()
    return proc, printed


@pytest.mark.parametrize("name", ["opt-actor", "llama-actor"])
def test_the_served_model_answers_as_transformers_generates(store, name: str) -> None:
    from transformers import AutoTokenizer

    from kubealign.data.tokenize import encode_prompt, plain_to_messages

    uri, models = store
    port = free_port()
    proc, printed = start(uri, name, port)
    try:
        ready = printed.strip().splitlines()[-1]
        assert ready.startswith(f"serve: {name}@champion (version 1) at http://127.0.0.1:{port}/v1, ready in")
        assert all(line.startswith("serve: ") for line in printed.strip().splitlines()), printed  # vLLM's: in its log
        tokenizer = AutoTokenizer.from_pretrained(models[name])
        for prompt in PROMPTS:
            ids = encode_prompt(tokenizer, prompt)  # as training and evaluate encode it
            expected = greedy(models[name], ids)
            done = post(
                port,
                "completions",
                {
                    "model": name,
                    "prompt": prompt,
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                },
            )
            tokens = [int(t.removeprefix("token_id:")) for t in done["choices"][0]["logprobs"]["tokens"]]
            assert [t for t in tokens if t != tokenizer.eos_token_id] == expected, (name, prompt)
            assert done["usage"]["prompt_tokens"] == len(ids)
            chat = post(
                port,
                "chat/completions",
                {
                    "model": name,
                    "messages": plain_to_messages(prompt),
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                },
            )
            assert chat["usage"]["prompt_tokens"] == len(ids)  # the template training's format rendered
            answer = chat["choices"][0]
            tokens = [int(t["token"].removeprefix("token_id:")) for t in answer["logprobs"]["content"]]
            assert [t for t in tokens if t != tokenizer.eos_token_id] == expected, (name, prompt)
            # the text as transformers decodes those tokens; vLLM holds back an unfinished UTF-8 character at
            # the end of a cut answer (a byte-level BPE token can end mid-character), transformers shows U+FFFD
            text = tokenizer.decode(expected, skip_special_tokens=True)
            assert answer["message"]["content"] == text.removesuffix("\ufffd"), (name, prompt)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
            assert "vllm:" in reply.read().decode()
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and rest.strip().endswith("serve: stopped"), rest[-2000:]
    with pytest.raises(OSError):  # nothing left listening: the server's process group went with it
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)


SHORTER = """
def shorter(prompts, completions, **columns):
    return [-float(len(c)) for c in completions]
"""


def test_the_judge_reads_real_servers_as_transformers_generates(store, tmp_path: Path) -> None:
    """Version 2 of opt-actor (the LLaMA model, promoted in canary mode: challenger) and the champion, each
    served by `kubealign serve` (vLLM), judged on 6 held-out prompts by a reward function (shorter is better):
    the judge's online win-rate and reward means equal those of transformers' greedy answers of the same two
    directories scored by the same function, and its verdict follows the gate."""
    import yaml
    from transformers import AutoTokenizer

    from kubealign.data import phases
    from kubealign.data.tokenize import encode_prompt

    uri, models = store
    argv = [
        str(KUBEALIGN),
        "promote",
        "--evaluation",
        str(evaluation(tmp_path, "llama", 0.8, 0.4, 1.2)),
        "--model-dir",
        str(models["llama-actor"]),
        "--output",
        str(tmp_path / "p"),
        "--set",
        "promote.registered_model=opt-actor",
        "--set",
        "promote.mode=canary",
    ]
    done = subprocess.run(
        argv, env=process_env({"MLFLOW_TRACKING_URI": uri}), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    split = tmp_path / "split"
    done = subprocess.run(
        [str(KUBEALIGN), "data-split", "--output", str(split), "--set", "tracking.enabled=false"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (tmp_path / "fns.py").write_text(SHORTER, encoding="utf-8")
    doc = {
        "rewards": {"model_weight": 0.0, "functions": [{"path": "fns.py:shorter"}]},
        "tracking": {"enabled": False},
        "canary": {"prompts": 6, "min_answers": 6, "max_new_tokens": NEW_TOKENS},
    }
    (tmp_path / "judge.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    ports = free_port(), free_port()
    servers = [start(uri, "opt-actor", ports[0])[0], start(uri, "opt-actor", ports[1], alias="challenger")[0]]
    try:
        argv = [
            str(KUBEALIGN),
            "judge",
            "--config",
            str(tmp_path / "judge.yaml"),
            "--prompts",
            str(split),
            "--tokenizer",
            str(models["opt-actor"]),
            "--champion",
            f"http://127.0.0.1:{ports[0]}",
            "--canary",
            f"http://127.0.0.1:{ports[1]}",
            "--served-name",
            "opt-actor",
            "--output",
            str(tmp_path / "j"),
        ]
        done = subprocess.run(argv, env=process_env({}), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        for proc in servers:
            os.kill(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=120)
    result = json.loads((tmp_path / "j" / "result.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(models["opt-actor"])
    prompts = phases.prompt_rows(phases.load(split, "phase3_prompts")["eval"]).prompts[:6]
    scores = {}
    for who, model in (("champion", models["opt-actor"]), ("canary", models["llama-actor"])):
        # vLLM's text holds back an unfinished UTF-8 character at the end of a cut answer (transformers: U+FFFD)
        tokens = [greedy(model, encode_prompt(tokenizer, p)) for p in prompts]
        texts = [tokenizer.decode(t, skip_special_tokens=True).rstrip("\ufffd") for t in tokens]
        scores[who] = [-float(len(t)) for t in texts]
    wins = sum(c > b + 1e-6 for b, c in zip(scores["champion"], scores["canary"], strict=True)) / 6
    m = result["metrics"]
    assert m["prompts"] == 6 and m["canary/errors"] == 0 and m["champion/errors"] == 0
    # each server's own request latency, from vLLM's /metrics histogram: within its bucket bounds, p50 <= p95
    for who in ("champion", "canary"):
        assert 0 < m[f"{who}/server_latency_p50_s"] <= m[f"{who}/server_latency_p95_s"] < 600
    assert m["win_rate"] == pytest.approx(wins)
    assert m["baseline_reward_mean"] == pytest.approx(sum(scores["champion"]) / 6)
    assert m["candidate_reward_mean"] == pytest.approx(sum(scores["canary"]) / 6)
    assert result["promoted"] == result["verdict"].endswith("promoted to champion")
    print(f"\njudge on real servers: {result['verdict']}")
