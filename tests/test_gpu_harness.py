"""The GPU proof's harness (benchmarks/gpu_rollout.py) without a GPU: its arithmetic by hand, and its CPU
dry mode end to end (tiny shapes, the same jobs and records a GPU run makes). Nothing here measures a GPU;
issue 17's figures come only from a run on one (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_core  # noqa: E402


def test_roofline_counts_weights_and_the_mean_kv_cache_by_hand():
    s = {"dtype": "bf16", "prompt_len": 8, "new_tokens": 8}
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    case = {"batch": 2, "ms_per_decode_step": 4.0}
    gpu_core.roofline(case, shape, 1000, s, 1e6)
    # weights 1000 x 2 bytes; KV: 2 (K, V) x 2 layers x 64 x batch 2 x (8 + 9/2 = 12.5 positions) x 2 bytes
    assert case["weight_bytes"] == 2000 and case["kv_bytes_mean"] == 12800
    assert case["min_step_ms"] == pytest.approx(2.0) and case["min_step_ms_with_kv"] == pytest.approx(14.8)
    assert case["roofline_fraction"] == pytest.approx(0.5)
    assert case["roofline_fraction_with_kv"] == pytest.approx(3.7)


def test_roofline_kv_uses_the_key_value_heads_and_fp32_widths():
    s = {"dtype": "fp32", "prompt_len": 4, "new_tokens": 3}
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 3}
    case = {"batch": 5, "ms_per_decode_step": 1.0}
    gpu_core.roofline(case, shape, 10, s, 1e3)
    # one kv head of 16 dims: 2 x 3 layers x 16 x 5 x (4 + 2 = 6) x 4 bytes; weights 10 x 4 bytes
    assert case["kv_bytes_mean"] == 11520 and case["weight_bytes"] == 40
    assert case["min_step_ms"] == pytest.approx(40.0)


def test_measure_takes_the_decode_step_from_full_minus_prefill(monkeypatch):
    calls = []

    def fake_timed(fn, n):  # 100 ms fixed + 10 ms per token; the second full run is the faster one
        calls.append(n)
        extra = 0.005 if len(calls) == 4 else 0.0
        return 0.1 + 0.01 * n + extra, fn(n)

    monkeypatch.setattr(gpu_core, "timed", fake_timed)
    # stops after 12 of 16 tokens (every row ended): generated tokens come from the output, not the request
    out = gpu_core.measure(lambda n: torch.zeros(3, 8 + min(n, 12)), 3, 8, 16, 2)
    assert calls == [16, 1, 1, 16, 16]  # warm-up, prefill x reps, full x reps
    assert out["generated_tokens"] == 12 and out["prefill_s"] == pytest.approx(0.11)
    assert out["full_s"] == pytest.approx(0.26) and out["full_s_runs"] == pytest.approx([0.265, 0.26])
    assert out["ms_per_decode_step"] == pytest.approx((0.26 - 0.11) / 11 * 1e3)
    assert out["tokens_per_s"] == pytest.approx(3 * 12 / 0.26)


def test_compare_finds_the_first_mismatching_step_and_its_margin():
    rollout = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 1], [5, 4, 8, 1]])
    reference = torch.tensor([[5, 6, 9], [5, 2, 8], [5, 3, 8]])  # ended one step earlier: 3 steps compared
    scores = [torch.zeros(3, 10) for _ in range(3)]
    scores[1][1, 2], scores[1][1, 6], scores[1][1, 4] = 3.0, 1.25, 1.0  # row 1's top-2 at step 1
    scores[1][2, 3] = 5.0  # row 2 also differs at step 1, with another margin: the first row is the one
    scores[2][0, 9] = 9.0  # a later mismatch (row 0, step 2) must not be the one
    found = gpu_core.compare(rollout, reference, scores, tie=2.0)
    assert found["compared_tokens"] == 9 and found["match_fraction"] == pytest.approx(6 / 9)
    assert not found["greedy_equal"] and found["first_mismatch"] == [1, 1]
    assert found["margin_at_mismatch"] == pytest.approx(1.75) and found["near_tie"]
    assert not gpu_core.compare(rollout, reference, scores, tie=1.0)["near_tie"]
    same = gpu_core.compare(reference, reference, scores, tie=1.0)
    assert same["greedy_equal"] and same["first_mismatch"] is None and not same["near_tie"]


def test_data_sheet_bandwidth_matches_a_variant_before_its_family():
    assert gpu_core.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_core.spec_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert gpu_core.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_core.spec_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu_core.spec_bandwidth("NVIDIA GeForce RTX 4090") is None and gpu_core.spec_bandwidth(None) is None


def test_dschat_epoch_hours_from_samples_per_second():
    epoch = gpu_core.dschat_epoch(131_900 / 7200, True)  # 2 hours for the 131.9k prompts
    assert epoch["hours"] == pytest.approx(2.0) and epoch["speedup_vs_published"] == pytest.approx(11.7 / 2)


def test_scrub_keeps_machine_paths_out_of_committed_results():
    tmp, root = os.path.join("/", "tmp"), os.path.join("/", "root")  # joined: no machine path in the source
    text = f"{REPO}/benchmarks/x.py and {tmp}/pytest-3/models/opt-1.3b-causal and {root}/.cache/a b"
    assert gpu_core.scrub(text) == "./benchmarks/x.py and <tmp>/opt-1.3b-causal and <tmp>/a b"


def test_run_sh_without_wheels_says_how_to_make_them(tmp_path: Path):
    env = {**os.environ, "WHL": str(tmp_path / "none"), "SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "generation"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "benchmarks/gpu/wheels.sh" in proc.stderr and not (tmp_path / "site").exists()


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict[str, dict]:
    """`gpu_rollout.py all --dry` once: the three records a GPU run writes, from tiny shapes on CPU. It
    inherits a launcher's variables naming a port another process holds (as from a test runner that set
    up its own process group): the benchmark must pick its own."""
    out, work = tmp_path_factory.mktemp("results"), tmp_path_factory.mktemp("work")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        launcher = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(held.getsockname()[1])}  # fmt: skip
        env = {**os.environ, **launcher, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, str(BENCH / "gpu_rollout.py"), "all", "--dry", "--out", str(out), "--work", str(work)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [f"gpu-{m}-cpu-dry.json" for m in ("correctness", "generation", "iteration")], files
    return {
        m: json.loads((out / f"gpu-{m}-cpu-dry.json").read_text()) for m in ("generation", "correctness", "iteration")
    }


def by_path(record: dict, model: str) -> dict[str, list[dict]]:
    cases: dict[str, list[dict]] = {}
    for case in record["cases"]:
        if case.get("model") == model:
            cases.setdefault(case["path"], []).append(case)
    return cases


def test_dry_records_say_what_ran_where(dry):
    for record in dry.values():
        assert record["command"].startswith("python3 benchmarks/gpu_rollout.py all --dry --out")
        assert record["settings"]["dry"] and record["random_init"]
        assert record["environment"]["gpu"] is None and record["environment"]["deepspeed"]
        assert str(REPO) not in json.dumps(record)  # results are committed: no machine paths


def test_dry_generation_times_each_path_or_says_why_not(dry):
    record = dry["generation"]
    assert record["roofline"]["spec_Bps"] is None and record["roofline"]["used_Bps"] > 0  # CPU: a measured copy
    opt = by_path(record, "opt-1.3b")
    for path, rollout_path in (("hf-eager", None), ("kubealign-engine-z2", "engine"), ("kubealign-he-z2", "he-plain")):
        (case,) = opt[path]
        assert case["status"] == "ok" and case.get("rollout_path") == rollout_path, case
        assert case["generated_tokens"] == 8 and case["ms_per_decode_step"] > 0
        assert case["roofline_fraction"] == pytest.approx(case["min_step_ms"] / case["ms_per_decode_step"])
    assert [c["status"] for c in opt["hf-static-compile"]] == ["skipped: needs CUDA"]
    (legacy,) = opt["legacy-he-injected-z2"]  # no side environment given: the variants stop at the first
    assert legacy["status"] == "skipped: needs CUDA" and legacy["injection_policies"] > 0
    llama = by_path(record, "llama-1.3b")
    assert llama["hf-eager"][0]["status"] == "ok"
    # DeepSpeed's hybrid engine cannot build LLaMA on CPU: recorded as an error line, the run goes on
    assert llama["kubealign-he-z2"][0]["status"] == "error" and "\n" not in llama["kubealign-he-z2"][0]["error"]


def test_dry_correctness_passes_each_training_path(dry):
    cases = dry["correctness"]["cases"]
    assert [c["path"] for c in cases] == [
        "kubealign-he-z2",
        "kubealign-he-z3",
        "kubealign-he-z2-lora",
        "kubealign-engine-z2",
    ]
    for case in cases:
        assert case["status"] == "ok" and case["passed"], case
        assert case["greedy_equal"] and case["compared_tokens"] == 2 * 8  # batch 2, 8 new tokens
        assert case["ratio_is_one_at_step_0"] and case["kl_is_zero_at_step_0"] and case["weights_changed"]


def test_dry_iteration_runs_the_ppo_stage_at_each_variant(dry):
    record = dry["iteration"]
    assert [c["variant"] for c in record["cases"]] == ["z2-lora", "z2-full", "z3-lora", "z3-full"]
    for case in record["cases"]:
        assert case["status"] == "ok" and case["rollout_path"] == "he-plain", case
        assert case["iterations"] == 2 and case["iterations_averaged"] == 1
        assert sum(case["time_share"].values()) == pytest.approx(1.0)
        mean = case["per_iteration_mean"]
        assert case["dschat_epoch"]["hours"] == pytest.approx(131_900 / mean["samples_per_s"] / 3600)
        assert not case["dschat_epoch"]["comparable"] and case["peak_rss_bytes"] > 0
