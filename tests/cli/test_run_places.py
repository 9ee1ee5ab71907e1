"""What `kubealign run`, `summary` and `rerun` say of times and places: the summary's time is each task's wall
time from run.json, a rerun names the directory it wrote, a missing data file is refused before the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubealign.pipelines import rerun as rerun_module


def write(run: Path, stage: str, payload: dict) -> None:
    (run / stage).mkdir(parents=True)
    (run / stage / "result.json").write_text(json.dumps(payload))


def test_summary_time_is_the_tasks_wall_time_from_run_json(cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # the stage itself reports 65.8 s (its training); the task, process start and op build included, took 179 s
    write(
        run,
        "reward",
        {"metrics": {"before_accuracy": 0.5, "after_accuracy": 0.9, "after_auc": 0.95, "wall_time_s": 65.8}},
    )
    write(run, "sft", {"metrics": {"before_perplexity": 100.0, "after_perplexity": 30.0, "wall_time_s": 9.2}})
    index = {
        "stages": {
            "reward": {"dir": str(run / "reward"), "sha256": "x", "wall_time_s": 179.04},
            "sft": {"dir": str(run / "sft"), "sha256": "y"},  # an older run.json: no task time, the stage's own
        }
    }
    (run / "run.json").write_text(json.dumps(index))
    lines = cli("summary", run).out.splitlines()
    assert lines[1].split()[:3] == ["sft", "9.2", "s"]
    assert lines[2].split()[:3] == ["reward", "179.0", "s"]


def test_rerun_says_where_it_wrote(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "demo-rerun-sft"
    write(out, "sft", {"metrics": {"before_perplexity": 100.0, "after_perplexity": 30.0}})
    index = {"stages": {"sft": {"dir": str(out / "sft")}}, "rerun": ["sft"], "reused": ["data-split"]}
    (out / "run.json").write_text(json.dumps(index))
    monkeypatch.setattr(rerun_module, "rerun", lambda *args, **kwargs: index)
    result = cli("rerun", "sft", "--from", tmp_path / "demo")
    assert result.code == 0, result.err
    assert f"rerun written to {out}; artifacts indexed in {out / 'run.json'}" in result.out.splitlines()


def test_a_missing_data_file_is_refused_before_the_run_starts(cli, tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    result = cli("run", "--set", f"data.sources=[{{path: {missing}}}]", "--output", tmp_path / "r")
    assert result.code == 2
    assert result.err.splitlines() == [f"kubealign: error: data.sources[0].path: no such file or directory: {missing}"]
    assert result.out == ""
    assert not (tmp_path / "r").exists()
