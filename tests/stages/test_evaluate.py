"""The evaluate stage: paired sampling, metrics that match the per-row scores, tables and plots."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kubealign.models import loading
from kubealign.stages.evaluate_report import headline
from tests.conftest import NO_TRACKING
from tests.stages.test_ppo import trained  # noqa: F401  (module-scoped fixture: split, sft, rm)
from tests.stages.test_training import result_of
from tests.support.models import DoubledLogits

pytestmark = pytest.mark.integration
SMALL = ["--set", NO_TRACKING, "--set", "evaluate.max_prompts=16", "--set", "evaluate.sample_rows=5"]


@pytest.fixture(scope="module")
def ppo_dir(trained, tmp_path_factory) -> Path:  # noqa: F811
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("ppo") / "ppo"
    args = ["ppo", "--prompts", trained["split"], "--actor", trained["sft"], "--critic", trained["rm"]]
    assert main([*map(str, args), "--set", NO_TRACKING, "--set", "ppo.num_iterations=8", "--output", str(out)]) == 0
    return out


def test_a_model_against_itself_ties_everywhere(cli, trained, tmp_path: Path):  # noqa: F811
    out = tmp_path / "eval"
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", trained["sft"]]
    result = cli(*args, "--reward", trained["rm"], *SMALL, "--output", out)
    assert result.code == 0, result.err
    m = result_of(out)["metrics"]
    # Same model, same seed, same prompts: identical samples, so every comparison is a tie and KL is 0.
    assert m["tie_rate"] == 1.0 and m["win_rate"] == 0.0 and m["loss_rate"] == 0.0
    assert m["kl_to_baseline"] == 0.0
    assert m["length_drift"] == 1.0 and m["reward_gain"] == 0.0
    assert m["baseline_perplexity"] == m["candidate_perplexity"]
    for figure in ("heldout_logprob", "repetition_rate", "distinct_2", "empty_rate", "unfinished_rate", "length_mean"):
        assert m[f"baseline_{figure}"] == m[f"candidate_{figure}"], figure  # every guard sees no change
    # the held-out reward model sees the same answers: ties, and the same call as the training one everywhere
    assert m["heldout_tie_rate"] == 1.0 and m["heldout_win_rate"] == 0.0 and m["reward_agreement"] == 1.0


@pytest.fixture(scope="module")
def evaluated(trained, ppo_dir: Path, tmp_path_factory) -> Path:  # noqa: F811
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("eval") / "eval"
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", ppo_dir]
    suites = ["--set", "evaluate.suites.tasks=[kubealign_facts]"]  # lm-eval-harness on the shipped task
    assert main([*map(str, args), "--reward", str(trained["rm"]), *SMALL, *suites, "--output", str(out)]) == 0
    return out


def test_the_suites_score_both_models_and_reach_the_summary(evaluated: Path, trained, ppo_dir: Path):  # noqa: F811
    from kubealign.cli.summary import evaluate_lines
    from kubealign.models import loading
    from tests.answers.test_suites import own_accuracy

    m = result_of(evaluated)["metrics"]
    tokenizer = loading.load_tokenizer(str(trained["sft"]))
    for who, path in (("baseline", trained["sft"]), ("candidate", ppo_dir)):
        model = loading.load_causal_lm(str(path)).eval()
        assert m[f"{who}_suite_kubealign_facts"] == pytest.approx(own_accuracy(model, tokenizer)), who
    base, cand = m["baseline_suite_kubealign_facts"], m["candidate_suite_kubealign_facts"]
    assert f"suites: kubealign_facts {base:.3f} (SFT) -> {cand:.3f} (PPO)" in evaluate_lines(m)


def test_candidate_metrics_match_the_rows(evaluated: Path):
    out = evaluated
    m = result_of(out)["metrics"]
    rows = json.loads((out / "eval_samples.json").read_text())
    assert len(rows) == m["prompts"] == 16
    diffs = [r["candidate_score"] - r["baseline_score"] for r in rows]
    assert m["win_rate"] == pytest.approx(sum(d > 1e-6 for d in diffs) / 16)
    assert m["tie_rate"] == pytest.approx(sum(abs(d) <= 1e-6 for d in diffs) / 16)
    assert m["candidate_reward_mean"] == pytest.approx(sum(r["candidate_score"] for r in rows) / 16)
    assert m["kl_to_baseline"] > 0  # PPO moved the policy
    assert 0 <= m["candidate_repetition_rate"] <= 1
    # the guards' figures: the log-likelihood is the perplexity's log; the page shows them above the samples
    assert m["candidate_perplexity"] == pytest.approx(math.exp(-m["candidate_heldout_logprob"]))
    assert m["baseline_heldout_logprob"] < 0 and 0 <= m["candidate_distinct_2"] <= 1
    page = (out / "samples.html").read_text()
    # header + sample_rows, the guard table's header + 7 figures, and the headline's rows above them
    assert page.count("<tr>") == 1 + 5 + 1 + 7 + len(headline(m)) and len(headline(m)) >= 4
    # the held-out reward model's figures are those of its per-row scores
    held = [r["candidate_heldout_score"] - r["baseline_heldout_score"] for r in rows]
    assert m["heldout_win_rate"] == pytest.approx(sum(d > 1e-6 for d in held) / 16)
    calls = [((h > 1e-6) - (h < -1e-6), (d > 1e-6) - (d < -1e-6)) for h, d in zip(held, diffs, strict=True)]
    assert m["reward_agreement"] == pytest.approx(sum(a == b for a, b in calls) / 16)
    assert m["heldout_reward_gain"] == pytest.approx(sum(held) / 16)
    assert held != diffs  # another model: not the training reward model's scores again
    assert f"<tr><td>distinct-2</td><td>{m['baseline_distinct_2']:.3f}</td><td>{m['candidate_distinct_2']:.3f}" in page
    assert "| guard figure | baseline | candidate |" in (out / "samples.md").read_text()
    assert "Human:" in page
    from PIL import Image

    assert Image.open(out / "reward_distribution.png").size == (600, 400)
    assert Image.open(out / "ppo_curves.png").size == (900, 650)  # the PPO history found; 50 px for the caption


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_sample_page_renders_its_table_in_headless_chromium(evaluated: Path, tmp_path: Path):
    shot = tmp_path / "samples.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1200,900",
        f"--screenshot={shot}",
    ]
    subprocess.run([CHROMIUM, *flags, (evaluated / "samples.html").as_uri()], capture_output=True, timeout=120)
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    width, height = image.size
    pixels = image.load()
    # The table's cell borders are #999 lines: count screen rows that are mostly border-grey.
    grey_rows = sum(
        1
        for y in range(height)
        if sum(1 for x in range(0, width, 4) if all(abs(c - 153) < 30 for c in pixels[x, y])) > width / 4 / 3
    )
    assert grey_rows >= 6, f"expected the 6 row borders of the sample table, found {grey_rows} grey lines"
    dark = sum(1 for x in range(0, width, 3) for y in range(0, height, 3) if sum(pixels[x, y]) < 200)
    assert dark > 500  # text was drawn


def test_missing_candidate_is_a_clean_error(cli, trained, tmp_path: Path):  # noqa: F811
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", tmp_path / "none"]
    result = cli(*args, "--reward", trained["rm"], *SMALL, "--output", tmp_path / "out")
    assert result.code == 2 and "--candidate" in result.err and len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_bad_evaluate_inputs_are_clean_errors(cli, trained, tmp_path: Path):  # noqa: F811
    """A causal LM as --reward would load with a random score head and feed the gate noise; lengths past
    the models' positions would end in an IndexError traceback deep in generate()."""
    import re

    split, sft, rm = trained["split"], trained["sft"], trained["rm"]
    cases = [
        (
            ["--reward", sft],
            r"--reward .*sft: is OPTForCausalLM, expected a \*ForSequenceClassification model \(the reward stage's output\)",
        ),
        (
            ["--reward", rm, "--baseline", rm],
            r"--baseline .*rm: is OPTForSequenceClassification, expected a \*ForCausalLM",
        ),
        (
            ["--reward", rm, "--set", "evaluate.max_new_tokens=600"],
            r"ppo\.max_prompt_len \+ evaluate\.max_new_tokens = 648 exceeds the baseline's max_position_embeddings 512 \(--baseline\)",
        ),
        (
            ["--reward", rm, "--set", "ppo.max_prompt_len=500"],
            r"ppo\.max_prompt_len \+ evaluate\.max_new_tokens = 524 exceeds",
        ),
        (
            ["--reward", rm, "--set", "sft.max_seq_len=513"],
            r"sft\.max_seq_len = 513 exceeds the baseline's max_position_embeddings 512",
        ),
    ]
    for args, pattern in cases:
        base = ["evaluate", "--prompts", split, "--baseline", sft, "--candidate", sft, *args]
        result = cli(*base, *SMALL, "--output", tmp_path / "out")
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1 and re.search(pattern, lines[0]), (args, result.err[-800:])
        assert not (tmp_path / "out").exists()


def test_bootstrap_lower_bound_by_hand():
    from kubealign.selection.comparison import bootstrap_lower_bound

    assert bootstrap_lower_bound([1.0] * 40, seed=0) == 1.0
    assert bootstrap_lower_bound([0.0] * 40, seed=0) == 0.0
    assert bootstrap_lower_bound([], seed=0) == 0.0
    # 30 wins of 60: the normal approximation puts the 2.5 % point at 0.5 - 1.96 * sqrt(0.25 / 60) = 0.373
    half = [1.0, 0.0] * 30
    assert 0.35 <= bootstrap_lower_bound(half, seed=0) <= 0.40
    assert bootstrap_lower_bound(half, seed=0) == bootstrap_lower_bound(half, seed=0)  # seeded
    # more evidence at the same rate tightens the bound towards it
    assert bootstrap_lower_bound(half * 10, seed=0) > bootstrap_lower_bound(half, seed=0) + 0.05
    # a wider interval has a lower lower end
    assert bootstrap_lower_bound(half, seed=0, level=0.99) < bootstrap_lower_bound(half, seed=0, level=0.8)


def test_compare_counts_wins_ties_and_bounds_the_win_rate():
    from kubealign.selection.comparison import bootstrap_lower_bound, compare

    base = [{"score": s, "tokens": [1] * n} for s, n in ((0.0, 2), (1.0, 4), (2.0, 6), (0.5, 3))]
    cand = [{"score": s, "tokens": [1, 2, 3]} for s in (1.0, 1.0, 1.0, 0.4)]
    m = compare(base, cand, seed=3)
    assert (m["win_rate"], m["tie_rate"], m["loss_rate"]) == (0.25, 0.25, 0.5)
    assert m["win_rate_lower_bound"] == bootstrap_lower_bound([1.0, 0.0, 0.0, 0.0], 3)
    assert m["baseline_length_median"] == 4.0 and m["candidate_length_mean"] == 3.0


def sabotaged_copy(rm: Path, out: Path) -> Path:
    """The reward model with its score head negated: it prefers exactly what the honest one rejects."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm)
    with torch.no_grad():
        for param in model.score.parameters():
            param.neg_()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(rm).save_pretrained(out)
    return out


def test_gate_refuses_a_candidate_trained_against_a_sabotaged_reward_model(cli, trained, tmp_path: Path):  # noqa: F811
    """PPO against a reward model that prefers rudeness, judged by the honest one: the gate registers the
    candidate as challenger and leaves champion alone (the demo shows the passing path)."""
    bad_rm = sabotaged_copy(trained["rm"], tmp_path / "bad-rm")
    ppo = tmp_path / "runs" / "ppo"
    args = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=10", "--set", "ppo.actor_learning_rate=3e-4"]
    result = cli(
        "ppo", "--prompts", trained["split"], "--actor", trained["sft"], "--critic", bad_rm, *args, "--output", ppo
    )
    assert result.code == 0, result.err
    evaluation = tmp_path / "runs" / "evaluate"
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", ppo]
    assert cli(*args, "--reward", trained["rm"], *SMALL, "--output", evaluation).code == 0
    assert cli(*args, "--reward", bad_rm, *SMALL, "--output", tmp_path / "by-the-sabotaged-rm").code == 0
    # by the measure it was trained on the candidate improved; by the honest reward model it got worse
    assert result_of(tmp_path / "by-the-sabotaged-rm")["metrics"]["reward_gain"] > 0
    m = result_of(evaluation)["metrics"]
    assert m["reward_gain"] < 0 and m["win_rate_lower_bound"] < 0.5
    promoted = cli("promote", "--evaluation", evaluation, "--model-dir", ppo, "--output", tmp_path / "runs" / "promote")
    assert promoted.code == 0, promoted.err
    payload = result_of(tmp_path / "runs" / "promote")
    assert payload["metrics"]["gate_passed"] == 0.0
    assert payload["aliases"] == {"challenger": 1, "champion": None, "previous-champion": None}
    assert any(line.startswith("FAIL: win_rate_lower_bound") for line in payload["gate"])


def test_dpo_pushed_to_degenerate_is_refused_by_a_guard(cli, trained, tmp_path: Path):  # noqa: F811
    """DPO with a tiny beta, a high learning rate, several epochs and no SFT term (rpo_alpha 0) learns to
    separate the pairs by pushing every likelihood down: the reward model may like what is left, the held-out
    log-likelihood does not (issue 53)."""
    dpo = tmp_path / "dpo"
    sets = ["dpo.beta=0.01", "dpo.rpo_alpha=0", "dpo.learning_rate=2e-3", "dpo.num_train_epochs=3", NO_TRACKING]
    args = [arg for item in sets for arg in ("--set", item)]
    assert cli("dpo", "--data", trained["split"], "--model", trained["sft"], *args, "--output", dpo).code == 0
    evaluation = tmp_path / "evaluate"
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", dpo]
    assert cli(*args, "--reward", trained["rm"], *SMALL, "--output", evaluation).code == 0
    m = result_of(evaluation)["metrics"]
    assert m["baseline_heldout_logprob"] - m["candidate_heldout_logprob"] > 1.0  # promote.guards.max_logprob_drop
    promoted = cli("promote", "--evaluation", evaluation, "--model-dir", dpo, "--output", tmp_path / "promote")
    assert promoted.code == 0, promoted.err
    payload = result_of(tmp_path / "promote")
    assert payload["metrics"]["gate_passed"] == 0.0 and payload["aliases"]["champion"] is None
    assert (
        payload["refusal"].startswith("gate refused: ") and "capability: held-out log-likelihood" in payload["refusal"]
    )
    assert payload["refusal"] in promoted.out


def test_evaluation_kl_is_tempered_and_unfiltered(trained):  # noqa: F811
    """KL(candidate || baseline) from the tempered softmax over the whole vocabulary, whatever top-k or
    top-p shaped the samples (losses.scaled_logits): the same with top_k 1 as without, finite, and exactly
    0 for a model against itself."""
    from kubealign.answers.sampling import sample
    from kubealign.answers.scoring import kl_to
    from kubealign.config.schema import EvaluateConfig
    from kubealign.data.tokenize import encode_prompt
    from kubealign.rl.losses import Sampling

    tokenizer = loading.load_tokenizer(str(trained["sft"]))
    model = loading.load_causal_lm(str(trained["sft"])).eval()

    prompts = [encode_prompt(tokenizer, p) for p in ("\n\nHuman: Tell me about bees.\n\nAssistant:",) * 2]
    cfg = EvaluateConfig(temperature=1.0, top_k=1, top_p=1.0, max_new_tokens=8, batch_size=2)
    rows = sample(model, tokenizer, prompts, cfg)  # greedy: also the sharper model's only possible sample
    greedy = kl_to(DoubledLogits(model), model, rows, 2, Sampling(1.0, 1, 1.0))
    assert greedy == kl_to(DoubledLogits(model), model, rows, 2, Sampling(1.0, 0, 1.0))  # the filter changes nothing
    assert greedy != 0 and math.isfinite(greedy)  # the softmaxes differ over the vocabulary
    assert kl_to(model, model, rows, 2, Sampling(0.7, 1, 0.5)) == 0.0
