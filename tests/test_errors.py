"""Bad input of every kind: exit code 2, one line naming the place, no traceback, nothing written."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NO_TRACKING, pairs, write_jsonl

GOOD = "".join(json.dumps(r) + "\n" for r in pairs(5))


def _file(tmp: Path, name: str, content: bytes | str) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


# (case id, builder(tmp) -> extra CLI args, regex the one-line message must match)
CASES = [
    (
        "bad-json",
        lambda t: ["--source", _file(t, "d.jsonl", GOOD + '{"prompt": "x",\n')],
        r"d\.jsonl:6: invalid JSON",
    ),
    (
        "bad-utf8",
        lambda t: ["--source", _file(t, "d.jsonl", GOOD.encode() + b'{"prompt": "\xff"}\n')],
        r"d\.jsonl:6: not valid UTF-8",
    ),
    (
        "wrong-type",
        lambda t: ["--source", _file(t, "d.jsonl", GOOD + '{"prompt": "p", "chosen": 1}\n')],
        r"d\.jsonl:6: field 'chosen': expected a string, got int",
    ),
    (
        "no-fields",
        lambda t: ["--source", _file(t, "d.jsonl", '{"text": "x"}\n')],
        r"d\.jsonl:1: no recognizable fields",
    ),
    (
        "not-object",
        lambda t: ["--source", _file(t, "d.jsonl", "[1, 2]\n")],
        r"d\.jsonl:1: expected a JSON object, got list",
    ),
    (
        "missing-field",
        lambda t: [
            "--source",
            _file(t, "d.jsonl", '{"prompt": "p", "response": "r"}\n'),
            "--set",
            "data.sources=[{path: " + str(t / "d.jsonl") + ", format: hh}]",
        ],
        r"d\.jsonl:1: field 'chosen': missing",
    ),
    (
        "bad-gzip",
        lambda t: ["--source", _file(t, "d.jsonl.gz", gzip.compress(GOOD.encode())[:-12])],
        r"d\.jsonl\.gz: not a valid gzip file",
    ),
    (
        "json-not-list",
        lambda t: ["--source", _file(t, "d.json", '{"prompt": "p"}')],
        r"d\.json: expected a JSON list of rows, got dict",
    ),
    (
        "json-syntax",
        lambda t: ["--source", _file(t, "d.json", '[\n{"prompt": }\n]')],
        r"d\.json:2:\d+: invalid JSON",
    ),
    (
        "bad-parquet",
        lambda t: ["--source", _file(t, "d.parquet", "not parquet")],
        r"d\.parquet: not a readable parquet file",
    ),
    (
        "missing-file",
        lambda t: ["--source", t / "nope.jsonl"],
        r"data\.sources\[0\]\.path: no such file or directory: .*nope\.jsonl",
    ),
    (
        "unsupported-file",
        lambda t: ["--source", _file(t, "d.csv", "a,b\n")],
        r"data\.sources\[0\]\.path: .*d\.csv: unsupported file type",
    ),
    (
        "missing-local-dataset",
        lambda t: ["--source", t / "nodir" / "x"],
        r"data\.sources\[0\]\.path: no such file",
    ),
    (
        "hub-offline",
        lambda t: ["--source", "no-such-org/no-such-dataset"],
        r"data\.sources\[0\]\.path: cannot load dataset 'no-such-org/no-such-dataset'",
    ),
    (
        "empty-source-file",
        lambda t: ["--source", _file(t, "empty.jsonl", "")],
        r"data\.sources\[0\]\.path: .*empty\.jsonl has no rows \(an empty jsonl source\)",
    ),
    (
        "blank-lines-only",
        lambda t: ["--source", "synthetic", "--source", _file(t, "blank.jsonl", "\n\n")],
        r"data\.sources\[1\]\.path: .*blank\.jsonl has no rows",
    ),
    (
        "all-rows-dropped",
        lambda t: ["--source", _file(t, "d.jsonl", '{"prompt": "p", "chosen": " ", "rejected": "r"}\n')],
        r"data\.sources: no usable rows \(1 read; dropped: empty_chosen 1\)",
    ),
    (
        "unknown-format",
        lambda t: ["--set", "data.sources=[{path: synthetic, format: csv}]"],
        r"field 'data\.sources\.0\.format' \(from --set\)",
    ),
    (
        "bad-ratios",
        lambda t: ["--set", "data.split_ratios=2,x,4"],
        r"field 'data\.split_ratios' \(from --set\): .*comma-separated numbers",
    ),
    (
        "unknown-key-in-file",
        lambda t: ["--config", _file(t, "c.yaml", "data:\n  sorces: []\n")],
        r"c\.yaml: field 'data\.sorces': unknown field",
    ),
    ("bad-yaml", lambda t: ["--config", _file(t, "c.yaml", "data: [\n")], r"c\.yaml:2:1: invalid YAML"),
    (
        "missing-config",
        lambda t: ["--config", t / "none.yaml"],
        r"--config .*none\.yaml: no such file and no such preset",
    ),
    ("bad-set-syntax", lambda t: ["--set", "data.seed"], r"--set 'data\.seed': expected section\.key=value"),
    (
        "synthetic-too-big",
        lambda t: ["--set", "data.synthetic_pairs=5000"],
        r"data\.synthetic_pairs \+ data\.synthetic_sft_rows = 6000 exceeds",
    ),
    (
        "output-is-file",
        lambda t: ["--output-override", _file(t, "taken", "x")],
        r"--output .*taken: exists and is not a directory",
    ),
]


@pytest.mark.parametrize(("builder", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(cli, tmp_path: Path, builder, pattern):
    args = [str(a) for a in builder(tmp_path)]
    output = tmp_path / "out"
    if args[:1] == ["--output-override"]:
        output, args = Path(args[1]), []
    before = set(tmp_path.iterdir())
    result = cli("data-split", *args, "--set", NO_TRACKING, "--output", output)
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("kubealign: error: ")
    assert re.search(pattern, lines[0]), lines[0]
    assert set(tmp_path.iterdir()) == before  # nothing half-written, no temp dirs left


def test_console_script_prints_no_traceback(tmp_path: Path):
    src = write_jsonl(tmp_path / "d.jsonl", pairs(3))
    src.write_text(src.read_text() + "{oops\n")
    exe = Path(sys.executable).parent / "kubealign"
    proc = subprocess.run(
        [exe, "data-split", "--source", src, "--set", NO_TRACKING, "--output", tmp_path / "o"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1] == f"kubealign: error: {src}:4: invalid JSON: "
        "Expecting property name enclosed in double quotes (column 2)"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_usage_errors_exit_2(cli):
    assert cli("tiny-model", "--arch", "gpt5", "--output", "x").code == 2
    assert cli("data-split").code == 2  # --output is required
