"""A version's manifest: what it records of the training, the data, the code, and its tags (kubealign.provenance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kubealign.config import load_config
from kubealign.errors import UserError
from kubealign.pipelines.reproduce import check_sources
from kubealign.provenance import digests, manifest

PPO_RESULT = {
    "stage": "ppo",
    "algorithm": "grpo",
    "metrics": {"world_size": 2},
    "rollout_engine": "compiled",
    "rollout_path": "he-plain",
    "environment": {"device": "NVIDIA H100", "versions": {"torch": "2.13.0", "vllm": None}},
    "history": [
        {"rollout_logprob_diff_max": 0.01, "rollout_logprob_diff_mean": 0.002},
        {"rollout_logprob_diff_max": 0.07, "rollout_logprob_diff_mean": 0.001},
        {"rollout_logprob_diff_max": 0.03, "rollout_logprob_diff_mean": 0.004},
        {"kl": 0.1},  # an iteration that logged none (a resumed one's first)
    ],
}


def test_the_training_record_keeps_the_largest_mismatch_of_any_iteration() -> None:
    record = manifest.training_record(PPO_RESULT)
    assert record == {
        "stage": "ppo",
        "algorithm": "grpo",
        "world_size": 2,
        "environment": PPO_RESULT["environment"],
        "rollout_engine": "compiled",
        "rollout_path": "he-plain",
        "max_logprob_diff": 0.07,
        "max_logprob_diff_mean": 0.004,
    }
    dpo = manifest.training_record({"stage": "dpo", "history": [{"loss": 0.6}]})
    assert (dpo["algorithm"], dpo["max_logprob_diff"], dpo["rollout_engine"]) == ("dpo", None, None)


def test_seeds_by_section() -> None:
    config = {"data": {"seed": 7, "sources": []}, "sft": {"seed": 1}, "ppo": {"seed": 3}, "tracking": {"uri": None}}
    assert manifest.seeds(config) == {"data.seed": 7, "sft.seed": 1, "ppo.seed": 3}


def test_the_manifest_and_its_tags() -> None:
    files = {"model.safetensors": "a" * 64, "config.json": "b" * 64}
    data = {
        "cache_key": "k" * 64,
        "config_sha256": "c" * 64,
        "sources": [{"path": "synthetic", "kind": "synthetic", "sha256": "s" * 64, "rows_read": 10}],
        "phases": {"phase1_sft": {"sha256": "p" * 64, "files_sha256": "f" * 64, "rows": 4}},
        "rows": {"kept": 10},
    }
    code = {"kubealign": "0.1.0", "commit": "abc", "dirty": False, "lock_sha256": "l" * 64}
    config = {"data": {"seed": 5}}
    built = manifest.build(config, files, manifest.training_record(PPO_RESULT), data, {"win_rate": 0.8}, {}, code)
    assert built["model_sha256"] == digests.combined_sha256(files)
    assert built["seeds"] == {"data.seed": 5}
    assert built["data"]["phases"] == {"phase1_sft": {"sha256": "p" * 64, "files_sha256": "f" * 64}}
    assert built["data"]["sources"] == data["sources"]
    assert manifest.tags(built) == {
        "kubealign.provenance.model_sha256": built["model_sha256"],
        "kubealign.provenance.commit": "abc",
        "kubealign.provenance.lock_sha256": "l" * 64,
        "kubealign.provenance.data_cache_key": "k" * 64,
        "kubealign.provenance.device": "NVIDIA H100",
        "kubealign.provenance.rollout_engine": "compiled",
        "kubealign.provenance.max_logprob_diff": "0.07",
        "kubealign.provenance.torch": "2.13.0",
    }  # vllm None and the absent libraries: no tag
    assert json.loads(manifest.dumps(built)) == built


def test_this_process_environment_and_code() -> None:
    env = manifest.environment()
    assert env["versions"]["torch"] == torch.__version__
    assert env["device"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    code = manifest.code_identity()
    repo = Path(__file__).resolve().parents[2]
    assert (
        code["lock_sha256"]
        == __import__("hashlib").sha256((repo / "requirements/lock-cpu.txt").read_bytes()).hexdigest()
    )
    assert len(code["commit"]) == 40 or code["commit"] == "unknown"


def test_the_image_revision_names_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(manifest.REVISION_ENV, "f" * 40)
    assert manifest.code_identity()["commit"] == "f" * 40


def test_a_changed_data_source_is_refused_in_one_line(tmp_path: Path) -> None:
    source = tmp_path / "pairs.jsonl"
    source.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n", encoding="utf-8")
    config = load_config("tiny-cpu", [f"data.sources=[{{path: {source}}}]"])
    from kubealign.data.sources import read_source

    then = read_source(0, config.data.sources[0], config.data).sha256
    recorded = {"data": {"sources": [{"path": str(source), "sha256": then}]}}
    check_sources(config, recorded, "m version 1")  # unchanged: nothing to say
    source.write_text(source.read_text(encoding="utf-8").replace('"a"', '"A"'), encoding="utf-8")
    with pytest.raises(UserError) as caught:
        check_sources(config, recorded, "m version 1")
    assert str(caught.value).startswith(f"reproduce: data.sources[0] {source} changed since m version 1 was made")
    with pytest.raises(UserError, match="was not made from this source"):
        check_sources(config, {"data": {"sources": []}}, "m version 1")
