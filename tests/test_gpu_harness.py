"""The GPU proof's harness (benchmarks/gpu_rollout.py) without a GPU: its arithmetic by hand, and its CPU
dry mode end to end (tiny shapes, the same jobs and records a GPU run makes). Nothing here measures a GPU;
issue 17's figures come only from a run on one (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_core  # noqa: E402
import gpu_jobs  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_rollout  # noqa: E402


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


def test_logprob_gap_counts_only_response_actions_by_hand():
    recorded = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, 0.0, -3.0, -9.0]])
    trainer = torch.tensor([[7.0, -1.5, -2.0, -0.25], [5.0, 0.0, -2.0, 0.0]])
    response = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])  # row 1's last action is past its EOS: not counted
    gap = gpu_core.logprob_gap(recorded, trainer, response)
    # |diffs| over the response: 0.5, 0, 0.25 (row 0), 1.0 (row 1); the prompt's 7 and 5 and the 9 left out
    assert gap == {"logprob_diff_mean": pytest.approx(1.75 / 4), "logprob_diff_max": 1.0, "logprob_tokens": 4}
    assert gpu_core.logprob_gap(None, trainer, response)["logprob_diff_mean"] is None  # the engine recorded none


def test_iteration_figures_are_samples_over_time_by_hand():
    # 2 s + 1 s + 1 s at 4 samples/s (16 samples), then 1 + 0.5 + 0.5 s at 8 samples/s (16 samples)
    history = [
        {"generation_time_s": 2.0, "experience_time_s": 1.0, "training_time_s": 1.0, "samples_per_s": 4.0},
        {"generation_time_s": 1.0, "experience_time_s": 0.5, "training_time_s": 0.5, "samples_per_s": 8.0},
    ]
    for h in history:
        h["response_length"] = 8.0
    found = gpu_core.iteration_figures(history)
    assert found["samples_per_s"] == pytest.approx(32 / 6)  # not the mean of the rates (6)
    assert found["generation_share"] == pytest.approx(3 / 6)
    assert found["per_iteration_mean"]["training_time_s"] == pytest.approx(0.75)
    assert found["time_share"] == pytest.approx({"generation": 0.5, "experience": 0.25, "training": 0.25})


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
    env = {**os.environ, "WHL": str(tmp_path / "none"), "SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", "generation"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
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
        launcher = {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(held.getsockname()[1]),
        }
        env = {**os.environ, **launcher, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        cmd = [sys.executable, str(BENCH / "gpu_rollout.py"), "all", "--dry", "--out", str(out), "--work", str(work)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    records = [f"gpu-{m}-cpu-dry.json" for m in ("correctness", "generation", "iteration")]
    assert files == [*records, "gpu-run-cpu-dry.jsonl"], files
    found = {
        m: json.loads((out / f"gpu-{m}-cpu-dry.json").read_text()) for m in ("generation", "correctness", "iteration")
    }
    found["run_log"] = [json.loads(line) for line in (out / "gpu-run-cpu-dry.jsonl").read_text().splitlines()]
    return found


def by_path(record: dict, model: str) -> dict[str, list[dict]]:
    cases: dict[str, list[dict]] = {}
    for case in record["cases"]:
        if case.get("model") == model:
            cases.setdefault(case["path"], []).append(case)
    return cases


@pytest.mark.integration  # tiny models run for seconds to minutes: not the fast tier
def test_dry_run_passes_once_over_each_case(dry):
    """The run log is appended to, never rewritten: a second pass over the cases (the script's main run
    twice, a child job started twice) shows there even though every records file is rewritten from zero."""
    events = dry["run_log"]
    (start,) = [e for e in events if e["event"] == "start"]
    assert [e["event"] for e in events].count("end") == 1
    planned = Counter(start["cases"])
    assert len(planned) > 20 and set(planned.values()) == {1}
    assert Counter(e["case"] for e in events if e["event"] == "case") == planned  # each case ended once
    children = Counter(e["case"] for e in events if e["event"] == "child")
    assert children and set(children.values()) == {1}  # the legacy import checks, one child each
    for measurement in ("generation", "correctness", "iteration"):  # a line per case (and batch measured)
        lines = Counter((c.get("model"), c["case"], c.get("batch")) for c in dry[measurement]["cases"])
        cases = {(model, case) for model, case, _ in lines}
        assert set(lines.values()) == {1} and len(cases) == sum(1 for c in planned if c.startswith(measurement))


def test_dry_records_say_what_ran_where(dry):
    for record in (dry[m] for m in ("generation", "correctness", "iteration")):
        assert record["command"].startswith("python3 benchmarks/gpu_rollout.py all --dry --out")
        assert record["settings"]["dry"] and record["random_init"]
        assert record["environment"]["gpu"] is None and record["environment"]["deepspeed"]
        assert str(REPO) not in json.dumps(record)  # results are committed: no machine paths


def test_dry_generation_times_each_path_or_says_why_not(dry):
    record = dry["generation"]
    assert record["roofline"]["spec_Bps"] is None and record["roofline"]["used_Bps"] > 0  # CPU: a measured copy
    opt = by_path(record, "opt-1.3b")
    paths = (
        ("hf-eager", None, None),
        ("kubealign-engine-z2", "engine", "hf"),
        ("kubealign-he-z2", "he-plain", "hf"),
        ("kubealign-compiled-z2", "he-plain", "compiled"),
    )
    for path, rollout_path, engine in paths:
        assert [c["batch"] for c in opt[path]] == [2, 3]  # one process, the smaller batch first
        for case in opt[path]:
            assert case["status"] == "ok" and case.get("rollout_path") == rollout_path, case
            assert case.get("rollout_engine") == engine, case
            # (full - prefill) / 7 decode steps; its sign is noise at 8 tiny tokens on a shared CPU
            step_ms = (case["full_s"] - case["prefill_s"]) / 7 * 1e3
            assert case["generated_tokens"] == 8 and case["ms_per_decode_step"] == pytest.approx(step_ms)
            assert case["full_s"] > 0 and case["prefill_s"] > 0 and case["ms_per_decode_step"] != 0
            assert case["roofline_fraction"] == pytest.approx(case["min_step_ms"] / case["ms_per_decode_step"])
    for path, _, _ in paths[1:]:  # each rollout engine against HF eager at the smaller batch, fp32: exact
        found = opt[path][0]["against_hf_eager"]
        assert found["batch"] == 2 and found["logprob_tokens"] == 2 * 8 and found["logprob_diff_max"] < 1e-4
        assert found["greedy_equal"] and found["compared_tokens"] == 2 * 8
    assert opt["kubealign-compiled-z2"][0]["compiled_graphs"] > 0  # the compiled engine did compile
    # a case per batch, named by the GPU's batch size
    assert [(c["case"], c["status"]) for c in opt["hf-static-compile"]] == [
        ("hf-static-compile-b16", "skipped: needs CUDA"),
        ("hf-static-compile-b64", "skipped: needs CUDA"),
    ]
    # on a CPU only the first legacy case runs a child (the side environment imports); the rest need CUDA
    legacy = sorted(opt["legacy-he-injected-z2"], key=lambda c: int(c["case"].rsplit("-b", 1)[1]))
    assert [c["case"] for c in legacy] == ["legacy-he-injected-z2-b16", "legacy-he-injected-z2-b64"]
    assert legacy[0]["status"] == "skipped: needs CUDA" and legacy[0]["injection_policies"] > 0
    assert legacy[0]["transformers"] and legacy[0]["side_environment"].startswith("none given")
    for case in legacy[1:] + opt["legacy-he-injected-z2-cuda-graph"] + opt["legacy-he-injected-z3"]:
        assert case["status"] == "skipped: needs CUDA" and "injection_policies" not in case
    llama = by_path(record, "llama-1.3b")
    assert llama["hf-eager"][0]["status"] == "ok"
    # DeepSpeed's hybrid engine cannot build LLaMA on CPU: recorded as an error line, the run goes on
    assert llama["kubealign-he-z2"][0]["status"] == "error" and "\n" not in llama["kubealign-he-z2"][0]["error"]


def test_dry_correctness_passes_each_training_path(dry):
    cases = dry["correctness"]["cases"]
    # cheapest first by gpu_plan's estimates
    assert [c["path"] for c in cases] == [
        "kubealign-engine-z2",
        "kubealign-he-z2",
        "kubealign-he-z2-lora",
        "kubealign-he-z3",
    ]
    for case in cases:
        assert case["status"] == "ok" and case["passed"], case
        assert case["greedy_equal"] and case["compared_tokens"] == 2 * 8  # batch 2, 8 new tokens
        assert case["ratio_is_one_at_step_0"] and case["kl_is_zero_at_step_0"] and case["weights_changed"]


def test_dry_iteration_runs_the_ppo_stage_at_each_variant(dry):
    record = dry["iteration"]
    assert [c["variant"] for c in record["cases"]] == [
        "z2-lora",
        "z2-lora-gb16",
        "z2-full",
        "z2-lora-gb64",
        "z3-lora",
        "z3-full",
        "z2-lora-compiled-gb16",
        "z2-lora-compiled-gb64",
    ]
    assert [c["estimate_s"] for c in record["cases"]] == sorted(c["estimate_s"] for c in record["cases"])
    for case in record["cases"]:
        assert case["status"] == "ok" and case["rollout_path"] == "he-plain", case
        # the GPU's generation batch 4 / 16 / 64 is the dry run's 2 / 4 / 8, the micro batch the preset's (dry: 2)
        gpu_batch = int(case["variant"].rsplit("-gb", 1)[1]) if "-gb" in case["variant"] else 4
        assert case["generation_batch_size"] == gpu_plan.DRY_GENERATION_BATCH[gpu_batch]
        assert case["micro_batch_size"] == 2
        assert f"ppo.generation_batch_size={case['generation_batch_size']}" in case["overrides"]
        assert case["rollout_engine"] == ("compiled" if "compiled" in case["variant"] else "hf")
        assert case["iterations"] == 2 and case["iterations_averaged"] == 1
        assert case["evaluation_and_export"].startswith("left out")
        assert sum(case["time_share"].values()) == pytest.approx(1.0)
        assert case["generation_share"] == pytest.approx(case["time_share"]["generation"])
        assert case["samples_per_s"] == pytest.approx(case["per_iteration_mean"]["samples_per_s"])  # one averaged
        assert case["dschat_epoch"]["hours"] == pytest.approx(131_900 / case["samples_per_s"] / 3600)
        assert not case["dschat_epoch"]["comparable"] and case["peak_rss_bytes"] > 0


def probe(name: str, estimate: float, *steps: dict) -> gpu_plan.Case:
    return gpu_plan.Case(
        "generation", name, estimate, {"model": "opt-1.3b", "path": "probe"}, {"job": "probe", "steps": list(steps)}
    )


def figures(n: int) -> dict:
    return {"add": {"batch": 2, "ms_per_decode_step": 1.0, "figure": n}}


def test_a_failing_dying_or_hanging_case_keeps_its_figures_and_stops_no_other(tmp_path: Path):
    """Each case in a child of its own (as on a GPU): one that raises after two figures (a CUDA error), one
    that dies without a word (a crashed process), one that hangs (killed at its timeout, 2 x 1.5 s): each
    keeps what it measured, and the case after them runs. The deadline (20 s) counts the time spent: a case
    estimated at 19 s fitted at the start but is skipped once the hang has taken its 3 s. (An 8 s deadline
    failed on a 2-core machine where each child's start, importing torch, takes 2-3 s: the fine case was cut.)"""
    cases = [
        probe("raises", 1, figures(1), figures(2), {"raise": "CUDA error: an illegal memory access"}),
        probe("dies", 1, figures(3), {"exit": 3}),
        probe("hangs", 1.5, figures(4), {"sleep": 60}),
        probe("fine", 1, figures(5)),
        probe("too-long", 19, figures(6)),
    ]
    args = argparse.Namespace(
        out=tmp_path / "out",
        label="probe",
        dry=True,
        argv=["generation"],
        deadline_s=20.0,
        isolate=True,
        legacy_site=None,
    )
    env = {"gpu": None}
    log = gpu_rollout.RunLog(args.out, args, env)
    (path,) = gpu_rollout.run(cases, args, tmp_path / "work", env, log)
    lines = json.loads(path.read_text())["cases"]
    assert [(c["case"], c["status"], c.get("figure")) for c in lines] == [
        ("raises", "ok", 1),
        ("raises", "ok", 2),
        ("raises", "error", None),
        ("dies", "ok", 3),
        ("dies", "error", None),
        ("hangs", "ok", 4),
        ("hangs", "timeout", None),
        ("fine", "ok", 5),
        ("too-long", lines[-1]["status"], None),
    ]
    assert "illegal memory access" in lines[2]["error"] and "exited with 3" in lines[4]["error"]
    assert lines[6]["timeout_s"] == 3.0 and 3.0 <= lines[6]["case_s"] < 10
    assert lines[-1]["status"].startswith("skipped: time budget (19 s estimated")
    assert all(c["roofline_fraction"] > 0 for c in lines if c["status"] == "ok")  # figures carry their roofline
    events = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert sorted(e["case"].rsplit(":", 1)[1] for e in events if e["event"] == "child") == [
        "dies",
        "fine",
        "hangs",
        "raises",
    ]


def test_legacy_runs_one_process_per_batch_size():
    """DeepSpeed sizes its inference workspace at the engine's first forward: each batch size of path (d)
    is a case (a process, an engine) of its own, and one failing stops none of the others."""
    cases = gpu_plan.plan(gpu_rollout.parse(["generation", "--arch", "opt", "--paths", "legacy"]), cuda=True)
    found = sorted((c.fields["path"], c.spec["batches"], c.spec["correctness"] is not None) for c in cases)
    assert found == [(f"legacy-{v}", [b], b == 16) for v, _, _ in gpu_core.LEGACY_VARIANTS for b in (16, 64)]
    assert all(c.spec["job"] == "legacy" and c.status is None for c in cases)


@pytest.mark.integration  # tiny models run for seconds to minutes: not the fast tier
def test_the_legacy_job_clears_a_stale_build_lock_first(tmp_path: Path):
    """A JIT build of an op killed at an earlier case's timeout leaves its lock, on which DeepSpeed would
    wait forever: path (d)'s child removes it before anything else (here it then stops: no CUDA)."""
    lock = tmp_path / "ext" / "transformer_inference" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")  # no process holds it: its builder is gone
    spec = {
        "job": "legacy",
        "shape": gpu_core.DRY_SHAPES["opt-1.3b"],
        "zero": 2,
        "cuda_graph": False,
        "batches": [2],
        "reps": 1,
        "prompt_len": 8,
        "new_tokens": 8,
        "correctness": None,
    }
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CUDA_VISIBLE_DEVICES": ""}
    result = gpu_jobs.subprocess_job(spec, 300, env)
    assert result["status"] == "skipped: needs CUDA" and result["stale_locks_removed"] == ["transformer_inference"]
    assert not lock.exists()


def test_an_only_that_matches_no_case_stops_before_any_work(tmp_path: Path):
    cmd = [
        sys.executable,
        str(BENCH / "gpu_rollout.py"),
        "generation",
        "--dry",
        "--only",
        "hf-eagre",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no case matches --only hf-eagre" in proc.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # no records, and no run log line either


def documented_calls() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "gpu.md").read_text()
    return re.findall(r"^\| (\d+) \| `bash benchmarks/gpu/run\.sh ([^`]+)` \| (\d+) s \|", text, re.M)


def test_each_documented_call_fits_its_budget_cheapest_first():
    """Every call docs/gpu.md lists: its cases ordered cheapest first and estimated (gpu_plan.ESTIMATES_S) as
    the docs state. Calls 1 and 2 (the headline) fit HEADLINE_BUDGET_S together, 1 on a machine just started and
    2 warm, and with the machine's start leave room in the session's device time; 3 (optional) is warm; every
    later call fits 480 s on a machine just started. Together the calls cover every case of the three
    measurements once, and item 4."""
    calls = documented_calls()
    assert [int(n) for n, _, _ in calls] == list(range(1, len(calls) + 1)) and len(calls) >= 5
    covered, steps, built, totals = Counter(), [], frozenset(), {}
    for number, command, stated in calls:
        argv = shlex.split(command)
        steps.append(argv[0])
        warm = int(number) in (2, 3)  # right after call 1 (and 2) on the same machine
        if argv[0] in ("tests", "padding-free"):
            total = gpu_plan.SETUP_S["run.sh"] + (gpu_plan.TESTS_S if argv[0] == "tests" else gpu_plan.PADDING_FREE_S)
        else:
            cases = gpu_plan.plan(gpu_rollout.parse(argv), cuda=True)
            assert cases and all(c.spec is not None for c in cases), command
            assert [c.estimate_s for c in cases] == sorted(c.estimate_s for c in cases), command
            covered.update(gpu_rollout.case_id(c) for c in cases)
            total = gpu_plan.call_estimate(cases, built=built if warm else frozenset())
            built = built | gpu_plan.models_built(cases) if int(number) <= 2 else built
        totals[int(number)] = total
        assert total <= gpu_plan.CALL_BUDGET_S, f"call {number}: {command}: {total:.0f} s"
        assert int(stated) == round(total), f"call {number}: docs say {stated} s, the plan {total:.0f} s"
    assert totals[1] + totals[2] <= gpu_plan.HEADLINE_BUDGET_S
    assert gpu_plan.MACHINE_START_S + gpu_plan.HEADLINE_BUDGET_S <= gpu_plan.SESSION_BUDGET_S - 60
    assert steps[:3] == ["all", "iteration", "correctness"]  # the headline first: rollout + correctness, ppo
    everything = gpu_plan.plan(gpu_rollout.parse(["all"]), cuda=True)
    assert covered == Counter(gpu_rollout.case_id(c) for c in everything)  # each case in exactly one call
    assert "tests" in steps and "padding-free" in steps
    run_sh = (BENCH / "gpu" / "run.sh").read_text()
    assert "DEADLINE_S=${DEADLINE_S:-540}" in run_sh  # cases are cut before the device's 600 s


def test_a_warm_call_pays_for_the_model_dirs_it_still_needs_and_not_for_run_sh_s_installs():
    cases = gpu_plan.plan(gpu_rollout.parse(["iteration", "--only", "z2-lora,z2-full"]), cuda=True)
    assert gpu_plan.models_built(cases) == {"opt-1.3b", "opt-350m", "prompts"}
    assert gpu_plan.call_estimate(cases) == 25 + 14 + 5 + 2 + 5 + 71 + 83  # a machine just started
    # after a call that built the actor and critic dirs: run.sh's import checks only, and the prompt split
    assert gpu_plan.call_estimate(cases, built=frozenset({"opt-1.3b", "opt-350m"})) == 13 + 14 + 5 + 71 + 83
    # a larger generation batch reads a prompt split of its own, built once
    wider = gpu_plan.plan(gpu_rollout.parse(["iteration", "--only", "z2-lora-gb16,z2-lora-compiled-gb16"]), cuda=True)
    assert gpu_plan.models_built(wider) == {"opt-1.3b", "opt-350m", "prompts-gb16"}
    assert gpu_plan.call_estimate(wider, built=gpu_plan.models_built(cases)) == 13 + 14 + 5 + 78 + 138


def session_calls() -> list[tuple[str, str, str, str, str]]:
    """docs/gpu.md's plan of the next GPU session (issue 74): call, DEADLINE_S, command, timeout_s, estimate."""
    text = (REPO / "docs" / "gpu.md").read_text()
    pattern = r"^\| (\d+) \| `DEADLINE_S=(\d+) bash benchmarks/gpu/run\.sh ([^`]+)` \| (\d+) \| (\d+) s \|"
    return re.findall(pattern, text, re.M)


def test_the_next_session_s_calls_fit_its_device_time():
    """Issue 74's session, as docs/gpu.md plans it: call 1 on a machine just started, each later one right after
    on the warm machine (run.sh's installs done, the model dirs and prompt splits built). Each call's estimate
    (recomputed from gpu_plan.ESTIMATES_S) is stated as the docs state it and fits its DEADLINE_S, and its
    timeout_s is 30 s above that, inside the device's 600 s. Even with every call running to its deadline, the
    machine's start, the calls and the waits between them fit the session's 900 s. It measures what the issue
    asks: the iteration at generation batch 4, 16 and 64 on the hf engine, the compiled engine's decode against
    the hf engine's, and the iteration with the compiled engine."""
    calls = session_calls()
    assert [int(n) for n, *_ in calls] == list(range(1, len(calls) + 1)) and len(calls) == 3
    built, deadlines, ran = frozenset(), 0, []
    for number, deadline, command, timeout, stated in calls:
        cases = gpu_plan.plan(gpu_rollout.parse(shlex.split(command)), cuda=True)
        assert cases and all(c.spec is not None for c in cases), command
        assert [c.estimate_s for c in cases] == sorted(c.estimate_s for c in cases), command
        total = gpu_plan.call_estimate(cases, built=built)
        built |= gpu_plan.models_built(cases)
        assert int(stated) == round(total), f"call {number}: docs say {stated} s, the plan {total:.0f} s"
        assert total <= int(deadline) and int(timeout) == int(deadline) + 30 <= 600, f"call {number}"
        deadlines += int(deadline)
        ran += cases
    budget = gpu_plan.MACHINE_START_S + deadlines + len(calls) * gpu_plan.CALL_GAP_S
    assert budget <= gpu_plan.SESSION_BUDGET_S, f"{budget:.0f} s"
    found = {
        (option(c, "ppo.rollout.engine"), int(option(c, "ppo.generation_batch_size")))
        for c in ran
        if c.measurement == "iteration"
    }
    assert {("hf", 4), ("hf", 16), ("hf", 64)} <= found and any(engine == "compiled" for engine, _ in found)
    generation = {(c.name, c.spec["engine"], tuple(c.spec["batches"])) for c in ran if c.measurement == "generation"}
    assert {("kubealign-he-z2", "hf", (16, 64)), ("kubealign-compiled-z2", "compiled", (16, 64))} <= generation


def option(case: gpu_plan.Case, key: str) -> str:
    """The value a case's --set overrides give KEY."""
    return next(o.split("=", 1)[1] for o in case.spec["overrides"] if o.startswith(f"{key}="))
