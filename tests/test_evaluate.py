"""The evaluate stage: paired sampling, metrics that match the per-row scores, tables and plots."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import NO_TRACKING
from tests.test_ppo import trained  # noqa: F401  (module-scoped fixture: split, sft, rm)
from tests.test_training import result_of

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


@pytest.fixture(scope="module")
def evaluated(trained, ppo_dir: Path, tmp_path_factory) -> Path:  # noqa: F811
    from kubealign.cli import main

    out = tmp_path_factory.mktemp("eval") / "eval"
    args = ["evaluate", "--prompts", trained["split"], "--baseline", trained["sft"], "--candidate", ppo_dir]
    assert main([*map(str, args), "--reward", str(trained["rm"]), *SMALL, "--output", str(out)]) == 0
    return out


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
    page = (out / "samples.html").read_text()
    assert page.count("<tr>") == 1 + 5  # header + sample_rows
    assert "Human:" in page
    from PIL import Image

    assert Image.open(out / "reward_distribution.png").size == (600, 400)
    assert Image.open(out / "ppo_curves.png").size == (900, 600)  # the candidate's PPO history was found


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_sample_page_renders_its_table_in_headless_chromium(evaluated: Path, tmp_path: Path):
    shot = tmp_path / "samples.png"
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,900", f"--screenshot={shot}",
    ]  # fmt: skip
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
