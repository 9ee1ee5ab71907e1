"""README.md's sample output of `make demo` keeps the shape of what `kubealign summary` prints for such a run:
the stage lines in order and the kinds of their continuation lines (numbers are the run's own, not compared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kubealign.cli.summary import summarize

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "stage          time  result"

RESULTS = {  # a demo run's result.json content, by hand: the metrics tiny-cpu's stages write
    "data-split": {"metrics": {"rows_kept": 2500, "phase1_sft_train_prompts": 1300, "wall_time_s": 1.8}},
    "sft": {"metrics": {"before_perplexity": 1056.1, "after_perplexity": 1.3, "wall_time_s": 29.2}},
    "reward": {"metrics": {"before_accuracy": 0.42, "after_accuracy": 1.0, "after_auc": 0.997, "wall_time_s": 6.3}},
    "ppo": {
        "metrics": {"reward_before": -0.5, "reward_after": 2.28, "kl_after": 1.28, "wall_time_s": 5.9},
        "kl_target": 1.5,
        "rollout_path": "he-plain",
    },
    "evaluate": {
        "metrics": {
            "baseline_reward_mean": -1.4,
            "candidate_reward_mean": 2.5,
            "reward_gain": 3.9,
            "win_rate": 0.8,
            "win_rate_lower_bound": 0.7,
            "tie_rate": 0.05,
            "kl_to_baseline": 2.2,
            "baseline_preferred_rate": 0.23,
            "candidate_preferred_rate": 0.98,
            "baseline_well_formed_rate": 1.0,
            "candidate_well_formed_rate": 1.0,
            "baseline_heldout_logprob": -2.0,
            "candidate_heldout_logprob": -2.1,
            "baseline_distinct_2": 0.6,
            "candidate_distinct_2": 0.5,
            "baseline_repetition_rate": 0.1,
            "candidate_repetition_rate": 0.1,
            "heldout_win_rate": 0.7,
            "heldout_reward_gain": 0.4,
            "reward_agreement": 0.7,
            "wall_time_s": 3.9,
        },
        "outputs": {"samples_html": "samples.html"},
    },
    "promote": {
        "metrics": {"gate_passed": 1.0, "version": 1.0, "wall_time_s": 4.0},
        "registered_model": "kubealign-actor",
        "version": 1,
        "aliases": {"challenger": 1, "champion": 1, "previous-champion": None},
        "refusal": "",
    },
}


def shape(lines: list[str]) -> list[str]:
    """Each line's kind: a stage line its stage's name, a continuation line its words before the first number."""
    kinds = []
    for line in lines:
        if line.strip().startswith("report: "):  # a path: its digits are not figures
            kinds.append("  report:")
        elif line.startswith(" "):
            kinds.append("  " + re.split(r"-?\d", line.strip(), maxsplit=1)[0].strip())
        else:
            kinds.append(line.split()[0])
    return kinds


def readme_sample() -> list[str]:
    """The summary table in README.md's sample output: from its header to the first blank line."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    end = lines.index("", start)
    return lines[start:end]


def test_the_readmes_sample_output_has_the_shape_of_a_runs_summary(tmp_path: Path):
    for stage, result in RESULTS.items():
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "result.json").write_text(json.dumps(result), encoding="utf-8")
    (tmp_path / "evaluate" / "samples.html").write_text("<html></html>", encoding="utf-8")
    summary = summarize(tmp_path)
    assert summary[0] == HEADER
    assert shape(readme_sample()) == shape(summary)
    kinds = shape(summary)  # what this test compares, so that it cannot pass vacuously
    assert "  preferred answers" in kinds and "  held-out reward model: win-rate" in kinds
    assert summary[kinds.index("  report:")].endswith(f"report: {tmp_path / 'evaluate' / 'samples.html'}")
    assert [k for k in kinds if not k.startswith(" ")][1:] == list(RESULTS)
