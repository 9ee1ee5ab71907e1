"""The data-split stage end to end: every source kind, real HH-RLHF data, cache, atomic output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kubealign.data.split import PHASES
from tests.conftest import NO_TRACKING, pairs, write_jsonl

pytestmark = pytest.mark.integration


def load_phases(output: Path) -> dict[str, datasets.DatasetDict]:
    return {phase: datasets.load_from_disk(str(output / phase)) for phase in PHASES}


def phase_prompts(output: Path) -> dict[str, set[str]]:
    loaded = load_phases(output)
    # every split: train, eval and phase 2's heldout (data.heldout_reward_fraction)
    return {p: set().union(*(loaded[p][split]["prompt"] for split in loaded[p])) for p in PHASES}


def manifest(output: Path) -> dict:
    return json.loads((output / "manifest.json").read_text())


def test_synthetic_default(cli, tmp_path: Path):
    out = tmp_path / "split"
    result = cli("data-split", "--set", NO_TRACKING, "--output", out)
    assert result.code == 0, result.err
    prompts = phase_prompts(out)
    # tiny-cpu: 1500 pairs -> 300/600/600 prompts; the 1000 SFT-only demonstrations join phase 1.
    assert [len(prompts[p]) for p in PHASES] == [1300, 600, 600]
    assert not (prompts[PHASES[0]] & prompts[PHASES[1]] or prompts[PHASES[1]] & prompts[PHASES[2]])
    assert not prompts[PHASES[0]] & prompts[PHASES[2]]
    res = json.loads((out / "result.json").read_text())
    assert res["stage"] == "data-split" and res["cache_hit"] is False
    assert res["metrics"]["phase2_reward_eval_prompts"] == 60
    assert res["metrics"]["phase2_reward_heldout_prompts"] == 135  # 0.25 of the 540 left for training
    assert res["outputs"]["phase1_sft"] == "phase1_sft"
    assert "phase1_sft" in result.out and "computed" in result.out
    phase2 = load_phases(out)["phase2_reward"]["train"]
    assert phase2.column_names == ["prompt", "chosen", "rejected", "columns", "source", "origin"]
    assert None not in phase2["rejected"]


def test_hh_rlhf_real_file_split_20_40_40_and_cache(cli, tmp_path: Path, hh_file: Path):
    out = tmp_path / "hh"
    first = cli("data-split", "--source", hh_file, "--set", NO_TRACKING, "--output", out)
    assert first.code == 0, first.err
    m = manifest(out)
    unique = sum(split["prompts"] for e in m["phases"].values() for split in e["splits"].values())
    prompts = phase_prompts(out)
    assert sum(len(v) for v in prompts.values()) == unique  # no prompt in two phases
    for phase, ratio in zip(PHASES, (0.2, 0.4, 0.4), strict=True):
        assert abs(len(prompts[phase]) - ratio * unique) <= 1, phase
    assert m["rows"]["read"] == 2312
    assert m["rows"]["kept"] == 2312 - sum(d["count"] for d in m["dropped"].values())
    assert m["sources"][0]["kind"] == "jsonl.gz"
    # Rerun on the same bytes: cache hit, nothing rewritten.
    arrow_before = sorted(p.stat().st_mtime_ns for p in (out / "phase1_sft").rglob("*.arrow"))
    again = cli("data-split", "--source", hh_file, "--set", NO_TRACKING, "--output", out)
    assert again.code == 0 and "cache hit" in again.out
    assert json.loads((out / "result.json").read_text())["cache_hit"] is True
    assert sorted(p.stat().st_mtime_ns for p in (out / "phase1_sft").rglob("*.arrow")) == arrow_before


def test_one_row_edit_is_a_cache_miss(cli, tmp_path: Path):
    src = write_jsonl(tmp_path / "d.jsonl", pairs(60))
    out = tmp_path / "out"
    assert cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out).code == 0
    key = manifest(out)["cache_key"]
    assert "cache hit" in cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out).out
    edited = pairs(60)
    edited[17]["chosen"] = " a better answer"
    write_jsonl(src, edited)
    result = cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out)
    assert result.code == 0 and "computed" in result.out
    assert manifest(out)["cache_key"] != key
    all_chosen = [c for d in load_phases(out).values() for s in d.values() for c in s["chosen"]]
    assert " a better answer" in all_chosen
    # A config change is a miss too.
    changed = cli("data-split", "--source", src, "--set", NO_TRACKING, "--set", "data.seed=9", "--output", out)
    assert "computed" in changed.out


def test_every_file_kind_and_dataset_dirs(cli, tmp_path: Path):
    rows = pairs(40)
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows[:10])
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows[10:20]).encode()))
    js = tmp_path / "c.json"
    js.write_text(json.dumps(rows[20:25]))
    pq.write_table(pa.Table.from_pylist(rows[25:30]), tmp_path / "d.parquet")
    disk = tmp_path / "disk"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[30:35])}).save_to_disk(str(disk))
    # A dataset laid out like a hub repo: datasets.load_dataset reads it through the same code path
    # that serves hub names.
    hub = tmp_path / "hub-style"
    (hub / "data").mkdir(parents=True)
    write_jsonl(hub / "data" / "train.jsonl", rows[35:40])
    config = tmp_path / "c.yaml"
    sources = [str(p) for p in (jsonl, gz, js, tmp_path / "d.parquet", disk, hub)]
    config.write_text(json.dumps({"data": {"sources": [{"path": s} for s in sources]}, "tracking": {"enabled": False}}))
    out = tmp_path / "out"
    result = cli("data-split", "--config", config, "--output", out)
    assert result.code == 0, result.err
    m = manifest(out)
    assert [s["kind"] for s in m["sources"]] == ["jsonl", "jsonl.gz", "json", "parquet", "disk", "dataset"]
    assert m["rows"] == {"read": 40, "kept": 40}
    assert set().union(*phase_prompts(out).values()) == {r["prompt"] for r in rows}
    origins = {o for d in load_phases(out).values() for s in d.values() for o in s["origin"]}
    assert f"{jsonl}:3" in origins and f"{js}:item 2" in origins


def test_drops_are_counted_with_locations(cli, tmp_path: Path):
    rows = pairs(20)
    rows[3] = dict(rows[2])  # duplicate of line 3 at line 4
    rows[5]["chosen"] = "   "
    rows[6]["rejected"] = rows[6]["chosen"]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    assert cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out).code == 0
    dropped = manifest(out)["dropped"]
    assert dropped["duplicate"] == {"count": 1, "examples": [f"{src}:4"]}
    assert dropped["empty_chosen"] == {"count": 1, "examples": [f"{src}:6"]}
    assert dropped["chosen_equals_rejected"] == {"count": 1, "examples": [f"{src}:7"]}
    assert manifest(out)["rows"]["kept"] == 17


def test_on_error_skip_reports_malformed_rows(cli, tmp_path: Path):
    src = tmp_path / "d.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in pairs(10))
    src.write_bytes(good.encode() + b'{"prompt": "x", \n' + b'{"prompt": "p", "chosen": 3}\n' + b"\xff\xfe\n")
    out = tmp_path / "out"
    result = cli("data-split", "--source", src, "--set", NO_TRACKING, "--set", "data.on_error=skip", "--output", out)
    assert result.code == 0, result.err
    invalid = manifest(out)["invalid"]
    assert invalid["count"] == 3
    assert [e["where"] for e in invalid["examples"]] == [f"{src}:11", f"{src}:12", f"{src}:13"]
    assert "field 'chosen'" in invalid["examples"][1]["error"]
    assert manifest(out)["rows"]["kept"] == 10


def test_limit_and_weight(cli, tmp_path: Path):
    a = write_jsonl(tmp_path / "a.jsonl", pairs(100))
    b = write_jsonl(tmp_path / "b.jsonl", pairs(100, start=100))
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "data": {
                    "sources": [{"path": str(a), "limit": 50}, {"path": str(b), "weight": 2.0}],
                    "split_ratios": "1,0,0",
                    "eval_fraction": 0.0,
                },
                "tracking": {"enabled": False},
            }
        )
    )
    out = tmp_path / "out"
    assert cli("data-split", "--config", config, "--output", out).code == 0
    train = load_phases(out)["phase1_sft"]["train"]
    assert train["source"].count(str(a)) == 50
    assert train["source"].count(str(b)) == 200


def test_failed_run_keeps_the_previous_output_and_leaves_no_temp(cli, tmp_path: Path):
    src = write_jsonl(tmp_path / "d.jsonl", pairs(30))
    out = tmp_path / "out"
    assert cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out).code == 0
    before = manifest(out)
    src.write_text(src.read_text() + "{not json}\n")
    result = cli("data-split", "--source", src, "--set", NO_TRACKING, "--output", out)
    assert result.code == 2
    assert manifest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "out"]


def test_prompt_completion_rows_feed_sft_and_an_undeclared_answer_is_refused(cli, tmp_path: Path):
    """TRL's prompt-completion rows were read as prompt-only rows: 60 of them gave phase 1 nothing and phase 3
    60 prompts, exit 0. Now they are SFT demonstrations; a prompt-only file with an `answer` field is a
    one-line error naming the file, the line and the field unless the source declares the column."""
    rows = [{"prompt": f"Q: {i}+{i}?", "completion": f" {2 * i}"} for i in range(60)]
    out = tmp_path / "pc"
    result = cli(
        "data-split", "--source", write_jsonl(tmp_path / "pc.jsonl", rows), "--set", NO_TRACKING, "--output", out
    )
    assert result.code == 0, result.err
    loaded = load_phases(out)
    sft = loaded["phase1_sft"]
    assert len(sft["train"]) + len(sft["eval"]) == 60 and set(sft["train"]["chosen"]) <= {r["completion"] for r in rows}
    assert len(loaded["phase3_prompts"]["train"]) + len(loaded["phase3_prompts"]["eval"]) == 0

    prompts = write_jsonl(
        tmp_path / "q.jsonl", [{"prompt": "Q: 1+1?", "level": 1}, {"prompt": "Q: 2+2?", "answer": "4"}]
    )
    refused = tmp_path / "refused"
    result = cli("data-split", "--source", prompts, "--set", NO_TRACKING, "--output", refused)
    assert result.code == 2 and not refused.exists()
    assert result.err.strip().splitlines()[-1] == (
        f"kubealign: error: {prompts}:2: field 'answer': looks like the row's answer, not a column: list it in the source's "
        "`columns` to give it to reward functions, or name it `completion` to train on it"
    )
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {"data": {"sources": [{"path": str(prompts), "columns": ["answer"]}]}, "tracking": {"enabled": False}}
        )
    )
    declared = tmp_path / "declared"
    assert cli("data-split", "--config", config, "--output", declared).code == 0
    phase3 = load_phases(declared)["phase3_prompts"]
    kept = [json.loads(c) for s in phase3.values() for c in s["columns"]]
    assert sorted(kept, key=len) == [{"level": 1}, {"answer": "4"}]
