"""`kubealign summary`: one line per stage result found in a run directory."""

from __future__ import annotations

import json
from pathlib import Path


def write(run: Path, stage: str, payload: dict) -> None:
    (run / stage).mkdir(parents=True)
    (run / stage / "result.json").write_text(json.dumps(payload))


def test_summary_lists_the_stages_with_their_headline_numbers(cli, tmp_path: Path):
    run = tmp_path / "demo"
    write(run, "sft", {"metrics": {"before_perplexity": 1029.0, "after_perplexity": 33.9, "wall_time_s": 9.24}})
    write(run, "promote", {"registered_model": "m", "version": 3, "aliases": {"champion": 3}, "metrics": {}})
    result = cli("summary", run)
    assert result.code == 0
    lines = result.out.splitlines()
    assert lines[1].split() == ["sft", "9.2", "s", "eval", "perplexity", "1029.0", "->", "33.9"]
    assert lines[2].endswith("m version 3; champion=3") and len(lines) == 3


def test_summary_of_an_empty_dir_is_an_error(cli, tmp_path: Path):
    result = cli("summary", tmp_path)
    assert result.code == 2 and "no stage results" in result.err


def test_summary_of_an_evaluation_on_the_synthetic_task_has_a_second_line(cli, tmp_path: Path):
    run = tmp_path / "demo"
    metrics = {
        "baseline_reward_mean": -1.5,
        "candidate_reward_mean": 2.25,
        "win_rate": 0.8,
        "win_rate_lower_bound": 0.7,
        "tie_rate": 0.1,
        "kl_to_baseline": 1.25,
        "baseline_preferred_rate": 0.2,
        "candidate_preferred_rate": 0.85,
        "baseline_well_formed_rate": 0.97,
        "candidate_well_formed_rate": 0.95,
        "wall_time_s": 3.0,
    }
    write(run, "evaluate", {"metrics": metrics})
    write(
        run,
        "promote",
        {"registered_model": "m", "version": 2, "aliases": {"champion": 2}, "metrics": {"gate_passed": 1.0}},
    )
    lines = cli("summary", run).out.splitlines()
    assert lines[1].endswith("win-rate 0.80 (95 % lower bound 0.70), ties 0.10, KL 1.250")
    assert lines[2].strip() == "preferred answers 20% (SFT) -> 85% (PPO), well formed 97% -> 95%"
    assert lines[2].startswith(" " * 21)
    assert lines[3].endswith("m version 2; gate passed; champion=2")


def test_summary_shows_the_guards_figures_and_a_refusal_on_a_line_of_its_own(cli, tmp_path: Path):
    run = tmp_path / "hacked"
    metrics = {
        "baseline_reward_mean": -1.5,
        "candidate_reward_mean": 2.25,
        "win_rate": 0.8,
        "win_rate_lower_bound": 0.7,
        "tie_rate": 0.0,
        "kl_to_baseline": 55.75,
        "baseline_heldout_logprob": -0.298,
        "candidate_heldout_logprob": -13.33,
        "baseline_distinct_2": 0.683,
        "candidate_distinct_2": 0.003,
        "baseline_repetition_rate": 0.0,
        "candidate_repetition_rate": 0.852,
    }
    write(run, "evaluate", {"metrics": metrics})
    refusal = "gate refused: capability: ...; the training reward model's gain +3.750 is not trusted (reward hacking suspected)"
    promoted = {"registered_model": "m", "version": 2, "aliases": {"champion": 1}, "metrics": {"gate_passed": 0.0}}
    write(run, "promote", {**promoted, "refusal": refusal})
    lines = cli("summary", run).out.splitlines()
    assert lines[2].strip() == (
        "held-out log-likelihood per token -0.298 (SFT) -> -13.330 (PPO), distinct-2 0.68 -> 0.00, "
        "repeated bigrams 0.00 -> 0.85"
    )
    assert lines[3].endswith("m version 2; gate refused; champion=1")
    assert lines[4] == " " * 21 + refusal and len(lines) == 5
    audited = {**promoted, "refusal": refusal, "model_sha256": "0123456789abcdef" * 4}
    (run / "promote" / "result.json").write_text(json.dumps(audited))
    lines = cli("summary", run).out.splitlines()
    audit = "model sha256 0123456789ab…, recipe in its provenance.json: kubealign reproduce m 2"
    assert lines[4] == " " * 21 + refusal and lines[5] == " " * 21 + audit and len(lines) == 6


def test_summary_sets_the_heldout_reward_model_beside_the_training_one(cli, tmp_path: Path):
    run = tmp_path / "fooled"
    metrics = {
        "baseline_reward_mean": -1.5,
        "candidate_reward_mean": 2.25,
        "win_rate": 0.8,
        "win_rate_lower_bound": 0.7,
        "tie_rate": 0.0,
        "kl_to_baseline": 5.5,
        "reward_gain": 3.75,
        "heldout_win_rate": 0.25,
        "heldout_reward_gain": -0.5,
        "reward_agreement": 0.3,
    }
    write(run, "evaluate", {"metrics": metrics})
    split = {"phase1_sft_train_prompts": 9, "phase1_sft_eval_prompts": 1, "phase2_reward_train_prompts": 14}
    split.update(phase2_reward_eval_prompts=2, phase2_reward_heldout_prompts=4, phase3_prompts_train_prompts=7)
    write(run, "data-split", {"metrics": {"rows_kept": 40, **split}})
    rm = {"before_accuracy": 0.5, "after_accuracy": 0.875, "after_auc": 0.9, "heldout/after_accuracy": 0.75}
    write(run, "reward", {"metrics": rm})
    lines = cli("summary", run).out.splitlines()
    assert lines[1].endswith("40 rows kept; prompts per phase 10/20/7")  # phase 2's heldout prompts counted
    assert lines[2].endswith("eval accuracy 0.50 -> 0.88, AUC 0.900; held-out model 0.75")
    lines = lines[2:]
    assert lines[2].strip() == (
        "held-out reward model: win-rate 0.25, gain -0.500 (the training one's +3.750); the two agree on 30% of "
        "the prompts"
    )


def test_summary_says_what_the_judge_decided_and_what_act_did(cli, tmp_path: Path):
    run = tmp_path / "canary"
    verdict = "judge: challenger (version 2) rolled back: win_rate: needs >= 0.5, got 0.000"
    write(run, "judge", {"verdict": verdict, "metrics": {"wall_time_s": 4.0}})
    done = (
        "registry challenger = None, champion = 1, previous-champion = None; InferenceService team-a/a updated, Ready"
    )
    write(run, "act", {"acted": True, "summary": done, "metrics": {"acted": 1.0}})
    lines = cli("summary", run).out.splitlines()
    assert lines[1:] == [f"{'judge':<11}{'4.0 s':>8}  {verdict}", f"{'act':<11}{'-':>8}  {done}"]
