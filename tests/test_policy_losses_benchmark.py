"""benchmarks/policy_losses.py's arithmetic on hand-made records: the ratios to ppo's time within one seed, the
summaries over seeds, what it reads from a GRPO stage's result.json. The stages themselves run only in the
benchmark (python benchmarks/policy_losses.py --quick is its smoke run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import policy_losses  # noqa: E402


def run(wall: float, cpu: float, gain: float | None = 0.1, kl: float = 1.0, **extra) -> dict:
    r = {"exit_code": 0, "wall_s": wall, "cpu_s": cpu, **extra}
    if gain is not None:  # evaluate finished
        r.update(accuracy_gain=gain, candidate_accuracy=0.5 + gain, baseline_accuracy=0.5, kl_to_baseline=kl)
    return r


def test_times_are_ratios_to_ppo_within_the_seed():
    losses = {"ppo": run(50, 80), "gspo": run(60, 100), "sapo": {"exit_code": 1, "wall_s": 5, "cpu_s": 4}}
    policy_losses.ratios_to_ppo(losses)
    assert losses["ppo"]["wall_vs_ppo"] == 1 and losses["ppo"]["cpu_vs_ppo"] == 1
    assert losses["gspo"]["wall_vs_ppo"] == pytest.approx(1.2) and losses["gspo"]["cpu_vs_ppo"] == pytest.approx(1.25)
    assert losses["sapo"]["wall_vs_ppo"] is None  # a failed stage's time is no figure of its loss


def test_no_ratio_without_a_finished_ppo_run():
    losses = {"ppo": {"exit_code": 1, "wall_s": 3, "cpu_s": 2}, "cispo": run(40, 60)}
    policy_losses.ratios_to_ppo(losses)
    assert losses["cispo"]["wall_vs_ppo"] is None and losses["cispo"]["cpu_vs_ppo"] is None


def test_summary_is_mean_min_max_over_the_seeds_that_finished():
    seeds = [
        {"losses": {"ppo": run(50, 80, gain=0.4, kl=1.0), "cispo": run(60, 90, gain=0.2, kl=2.0)}},
        {"losses": {"ppo": run(40, 60, gain=0.2, kl=3.0), "cispo": run(20, 30, gain=0.5, kl=1.0)}},
        {"losses": {"ppo": run(45, 70, gain=0.3, kl=2.0), "cispo": run(45, 70, gain=None, non_finite_loss=True)}},
    ]
    for s in seeds:
        policy_losses.ratios_to_ppo(s["losses"])
    out = policy_losses.summary(seeds, ["ppo", "cispo"])
    assert out["ppo"]["accuracy_gain"] == pytest.approx({"mean": 0.3, "min": 0.2, "max": 0.4, "seeds": 3})
    assert out["ppo"]["kl_to_baseline"] == pytest.approx({"mean": 2.0, "min": 1.0, "max": 3.0, "seeds": 3})
    assert out["ppo"]["wall_vs_ppo"] == {"mean": 1.0, "min": 1.0, "max": 1.0, "seeds": 3}
    # cispo's third seed never reached evaluate: it counts as failed, not as a zero
    assert out["cispo"]["accuracy_gain"] == pytest.approx({"mean": 0.35, "min": 0.2, "max": 0.5, "seeds": 2})
    assert out["cispo"]["wall_vs_ppo"] == pytest.approx({"mean": (1.2 + 0.5) / 2, "min": 0.5, "max": 1.2, "seeds": 2})
    assert out["cispo"]["failed"] == 1 and out["cispo"]["non_finite_loss"] == 1 and out["ppo"]["failed"] == 0
    assert out["cispo"]["rollout_logprob_diff_max"] is None  # not in these records: nothing to summarize
    table = policy_losses.table(out).splitlines()
    assert table[2].startswith("| ppo | 80% (70% to 90%) | +30% (+20% to +40%) | 2.00 (1.00 to 3.00) |")
    assert table[3].endswith("| — | 1 / 1 |") and len(table) == 4


def test_one_seed_is_shown_without_a_range():
    assert policy_losses.cell({"mean": 0.25, "min": 0.25, "max": 0.25, "seeds": 1}, ".0%") == "25%"
    assert policy_losses.cell(None, ".2f") == "—"


def test_grpo_figures_reads_the_check_the_mismatch_and_non_finite_history():
    history = [
        {
            "iteration": 1,
            "reward_mean": 0.2,
            "clip_fraction": 0.0,
            "rollout_logprob_diff_mean": 0.0,
            "rollout_logprob_diff_max": 0.0,
        },
        {
            "iteration": 2,
            "reward_mean": 0.4,
            "clip_fraction": 0.1,
            "rollout_logprob_diff_mean": 2e-6,
            "rollout_logprob_diff_max": 5e-6,
            "policy_loss": float("nan"),
        },
    ]
    metrics = {"wall_time_s": 9.0, "kl_after": 0.5, "fn/exact_answer/before": 0.25, "fn/exact_answer/after": 0.75}
    out = policy_losses.grpo_figures({"metrics": metrics, "history": history})
    assert out["check_accuracy_before_after"] == [0.25, 0.75] and out["grpo_kl_after"] == 0.5
    assert out["train_reward_first10_last10"] == pytest.approx([0.3, 0.3])
    assert out["rollout_logprob_diff_mean"] == pytest.approx(1e-6) and out["rollout_logprob_diff_max"] == 5e-6
    assert out["clip_fraction_mean"] == pytest.approx(0.05)
    assert out["nonfinite_history"] == ["2:policy_loss"] and out["non_finite_loss"]


def test_quick_mode_and_the_users_overrides():
    args = policy_losses.parse(["--quick", "--set", "ppo.num_iterations=5"])
    assert args.seeds == [1234] and args.max_wait == 0 and args.label.endswith("-quick")
    assert args.overrides[-1] == "ppo.num_iterations=5"  # after QUICK's: the user's setting wins
    full = policy_losses.parse([])
    assert full.seeds == [1234, 1, 2] and full.losses == ["ppo", "gspo", "cispo", "sapo"] and full.max_wait == 300
    assert full.label == "policy-losses-tiny-cpu-verifiable" and full.overrides == []
