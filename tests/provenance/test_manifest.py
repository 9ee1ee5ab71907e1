"""A version's manifest: what it records of the training, the data, the code, and its tags (kubealign.provenance)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

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
    "environment": {
        "device": "NVIDIA H100",
        "versions": {
            "torch": "2.13.0",
            "transformers": "5.23.0",
            "deepspeed": "0.19.8",
            "vllm": None,
            "peft": "0.21.2",
        },
    },
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
    training = manifest.training_record(PPO_RESULT)
    runs = {"pipeline_run_id": "r1"}
    built = manifest.build(config, files, training, data, {"win_rate": 0.8}, runs, code)
    assert built == {
        "schema": 1,
        "model_sha256": digests.combined_sha256(files),
        "files": files,
        "config": config,
        "seeds": {"data.seed": 5},
        "code": code,
        "data": {
            "cache_key": "k" * 64,
            "config_sha256": "c" * 64,
            "sources": data["sources"],
            "phases": {"phase1_sft": {"sha256": "p" * 64, "files_sha256": "f" * 64}},
        },
        "training": training,
        "evaluation": {"win_rate": 0.8},
        "runs": runs,
    }
    bare = manifest.build(config, files, training, {"cache_key": "k"}, {}, runs, code)["data"]
    assert bare == {"cache_key": "k", "config_sha256": None, "sources": [], "phases": {}}
    assert manifest.build(config, files, training, None, {}, runs, code)["data"] is None
    assert manifest.tags(built) == {
        "kubealign.provenance.model_sha256": built["model_sha256"],
        "kubealign.provenance.commit": "abc",
        "kubealign.provenance.lock_sha256": "l" * 64,
        "kubealign.provenance.data_cache_key": "k" * 64,
        "kubealign.provenance.device": "NVIDIA H100",
        "kubealign.provenance.rollout_engine": "compiled",
        "kubealign.provenance.max_logprob_diff": "0.07",
        "kubealign.provenance.torch": "2.13.0",
        "kubealign.provenance.transformers": "5.23.0",
        "kubealign.provenance.deepspeed": "0.19.8",
    }  # vllm None: no tag; peft is in the manifest, not a tag
    with_vllm = {**built, "training": {**training, "environment": {"versions": {"vllm": "0.32.0"}}}}
    assert manifest.tags(with_vllm)["kubealign.provenance.vllm"] == "0.32.0"
    assert json.loads(manifest.dumps(built)) == built


def test_this_process_environment() -> None:
    env = manifest.environment()
    assert env["versions"]["torch"] == torch.__version__ and env["versions"]["transformers"] == transformers.__version__
    assert env["device"] == ("cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(0))
    assert env["torch_threads"] == torch.get_num_threads()
    import platform

    import datasets
    import deepspeed
    import mlflow
    import peft

    assert (env["python"], env["platform"], env["cuda"]) == (
        platform.python_version(),
        platform.platform(),
        torch.version.cuda,
    )
    libraries = {"deepspeed": deepspeed, "peft": peft, "datasets": datasets, "mlflow": mlflow}
    assert {name: env["versions"][name] for name in libraries} == {n: m.__version__ for n, m in libraries.items()}
    assert set(env["versions"]) == {"torch", "transformers", "deepspeed", "peft", "datasets", "mlflow", "vllm"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_the_code_of_a_checkout_its_commit_lock_and_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(manifest.REVISION_ENV, raising=False)
    repo, package = tmp_path / "repo", tmp_path / "repo" / "kubealign"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_bytes(b"A = 1\n")
    (package / "sub" / "b.py").write_bytes(b"B = 2\n")
    (repo / "requirements").mkdir()
    (repo / "requirements" / "lock-cpu.txt").write_bytes(b"torch==2.13.0\n")
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    code = manifest.code_identity(package)
    assert code["commit"] == git(repo, "rev-parse", "HEAD") and code["dirty"] is False
    assert code["lock_sha256"] == hashlib.sha256(b"torch==2.13.0\n").hexdigest()
    assert code["package_sha256"] == hashlib.sha256(b"a.py\0A = 1\n\0sub/b.py\0B = 2\n\0").hexdigest()
    (package / "a.py").write_bytes(b"A = 3\n")  # a tracked file edited after the commit
    edited = manifest.code_identity(package)
    assert edited["dirty"] is True and edited["package_sha256"] != code["package_sha256"]
    monkeypatch.setenv(manifest.REVISION_ENV, "f" * 40)  # an image: its build's revision, no checkout asked
    assert manifest.code_identity(package)["commit"] == "f" * 40
    (repo / "requirements" / "lock-cpu.txt").unlink()
    import shutil

    shutil.rmtree(repo / ".git")
    alone = manifest.code_identity(package)
    assert (alone["lock_sha256"], alone["dirty"]) == (None, None)


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
