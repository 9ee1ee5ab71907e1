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
