"""The files of a model directory as digests, and the check of a copy against them (kubealign.provenance)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kubealign.errors import UserError
from kubealign.provenance import compare, digests, manifest


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def model_dir(root: Path) -> Path:
    (root / "critic").mkdir(parents=True)
    (root / "config.json").write_bytes(b'{"a": 1}')
    (root / "model.safetensors").write_bytes(b"weights-0")
    (root / "critic" / "model.safetensors").write_bytes(b"weights-1")
    (root / ".complete").write_bytes(b"a download's marker")  # hidden: not part of the model
    return root


def test_every_file_below_the_directory_by_relative_path_hidden_ones_left_out(tmp_path: Path) -> None:
    files = digests.file_digests(model_dir(tmp_path))
    assert files == {
        "config.json": sha(b'{"a": 1}'),
        "critic/model.safetensors": sha(b"weights-1"),
        "model.safetensors": sha(b"weights-0"),
    }


def test_a_file_larger_than_a_block_is_hashed_whole(tmp_path: Path) -> None:
    data = bytes(range(256)) * (digests.BLOCK // 256) + b"tail"  # one block and 4 bytes more
    (tmp_path / "big.bin").write_bytes(data)
    assert digests.file_sha256(tmp_path / "big.bin") == sha(data)


def test_the_combined_digest_sees_a_renamed_file_as_it_sees_a_changed_byte() -> None:
    base = {"a.safetensors": "1" * 64, "b.json": "2" * 64}
    expected = sha(f"a.safetensors\0{'1' * 64}\nb.json\0{'2' * 64}\n".encode())
    assert digests.combined_sha256(base) == expected
    assert digests.combined_sha256(dict(reversed(base.items()))) == expected  # order of the dict does not matter
    renamed = {"c.safetensors": "1" * 64, "b.json": "2" * 64}
    changed = {"a.safetensors": "3" * 64, "b.json": "2" * 64}
    assert len({expected, digests.combined_sha256(renamed), digests.combined_sha256(changed)}) == 3


def test_mismatches_name_each_file_in_path_order() -> None:
    recorded = {"a": "1" * 64, "b": "2" * 64, "c": "3" * 64}
    copy = {"a": "1" * 64, "b": "f" * 64, "d": "4" * 64}
    assert digests.mismatches(copy, recorded) == [
        f"b has sha256 {'f' * 12}…, the manifest records {'2' * 12}…",
        "c is missing",
        "d is not in the manifest",
    ]
    assert digests.mismatches(recorded, recorded) == []


def test_one_flipped_byte_is_one_line_naming_the_file(tmp_path: Path) -> None:
    directory = model_dir(tmp_path)
    recorded = digests.file_digests(directory)
    digests.verify(directory, recorded, "serve: m version 1")  # the same files pass
    weights = directory / "critic" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[3] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError) as caught:
        digests.verify(directory, recorded, "serve: m version 1")
    now = hashlib.sha256(bytes(data)).hexdigest()[:12]
    assert str(caught.value) == (
        f"serve: m version 1: critic/model.safetensors has sha256 {now}…, the manifest records {sha(b'weights-1')[:12]}…: "
        "the files are not the registered ones; refusing to load them"
    )
    (directory / "config.json").unlink()
    with pytest.raises(UserError, match=r"config.json is missing \(and 1 more\)"):
        digests.verify(directory, recorded, "serve: m version 1")


def test_the_weight_files_compared_and_the_rest_left_to_the_manifest() -> None:
    recorded = {
        "model.safetensors": "1",
        "critic/model.safetensors": "2",
        "ema/model.safetensors": "3",
        "result.json": "4",
    }
    made = {"model.safetensors": "1", "critic/model.safetensors": "9", "extra.bin": "5", "result.json": "different"}
    assert manifest.weights(made) == {"model.safetensors": "1", "critic/model.safetensors": "9", "extra.bin": "5"}
    assert compare.compare_weights(made, recorded) == compare.WeightsCompared(
        identical=["model.safetensors"],
        different=["critic/model.safetensors"],
        missing=["ema/model.safetensors"],
        extra=["extra.bin"],
    )


def test_the_largest_parameter_difference_and_where_it_is(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b, a / "critic", b / "critic"):
        d.mkdir(exist_ok=True)
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_file({"w": w, "v": torch.ones(2)}, str(a / "model.safetensors"))
    moved = w.clone()
    moved[1, 2] += 0.25  # the one place that differs in the actor
    save_file({"w": moved, "v": torch.ones(2)}, str(b / "model.safetensors"))
    save_file({"h": torch.zeros(3), "only_a": torch.ones(1)}, str(a / "critic" / "model.safetensors"))
    save_file({"h": torch.tensor([0.0, -0.5, 0.0])}, str(b / "critic" / "model.safetensors"))
    found = compare.largest_difference(a, b)
    assert found == {
        "max_abs_diff": 0.5,
        "tensor": "critic/model.safetensors:h",
        "shapes_differ": ["critic/model.safetensors:only_a"],
    }
    (a / "critic" / "model.safetensors").unlink()
    assert compare.largest_difference(a, b) == {
        "max_abs_diff": 0.25,
        "tensor": "model.safetensors:w",
        "shapes_differ": [],
    }


def test_figures_side_by_side_only_where_both_have_them() -> None:
    lines = compare.figures_side_by_side(
        {"win_rate": 0.75, "kl": 1.0}, {"win_rate": 0.8, "other": 2.0}, ("win_rate", "kl")
    )
    assert lines == ["win_rate: registered 0.7500, remade 0.8000 (+0.0500)"]


def test_equal_weights_differ_by_nothing_and_the_first_of_equal_differences_is_named(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    save_file({"a_only": torch.ones(1), "empty": torch.zeros(0), "x": torch.full((2,), 0.5)}, str(a / "m.safetensors"))
    save_file({"empty": torch.zeros(0), "x": torch.full((2,), 0.5)}, str(b / "m.safetensors"))
    assert compare.largest_difference(a, b) == {
        "max_abs_diff": 0.0,
        "tensor": "m.safetensors:empty",
        "shapes_differ": ["m.safetensors:a_only"],
    }
    save_file({"empty": torch.zeros(0), "x": torch.tensor([0.75, 0.5]), "y": torch.zeros(1)}, str(b / "m.safetensors"))
    save_file(
        {"a_only": torch.ones(1), "empty": torch.zeros(0), "x": torch.full((2,), 0.5), "y": torch.full((1,), -0.25)},
        str(a / "m.safetensors"),
    )
    # x and y both differ by 0.25 at most: the first in name order is named
    assert compare.largest_difference(a, b) == {
        "max_abs_diff": 0.25,
        "tensor": "m.safetensors:x",
        "shapes_differ": ["m.safetensors:a_only"],
    }
