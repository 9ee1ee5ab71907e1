"""Tiny models: built locally (no hub), deterministic, self-contained, loadable by name or path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kubealign.config.cache import cache_root
from kubealign.errors import UserError
from kubealign.models import loading, tiny

pytestmark = pytest.mark.integration


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_opt() -> Path:
    return Path(loading.resolve("tiny-opt"))


@pytest.mark.parametrize(("arch", "model_type"), [("opt", "opt"), ("llama", "llama")])
def test_cli_builds_a_self_contained_tiny_model(cli, tmp_path: Path, arch: str, model_type: str):
    out = tmp_path / arch
    assert cli("tiny-model", "--arch", arch, "--output", out).code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["num_hidden_layers"] == tiny.LAYERS == 2 and config["hidden_size"] == tiny.HIDDEN == 128
    assert config["vocab_size"] == tiny.VOCAB_SIZE
    if arch == "llama":
        assert config["num_key_value_heads"] == config["num_attention_heads"]  # no GQA
    assert {"model.safetensors", "tokenizer.json", "generation_config.json", "result.json"} <= {
        p.name for p in out.iterdir()
    }
    model = loading.load_causal_lm(str(out))  # HF_HUB_OFFLINE=1 is set for the whole session
    tokenizer = loading.load_tokenizer(str(out))
    batch = tokenizer(["\n\nHuman: Tell me about cats.\n\nAssistant:"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], tiny.VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path):
    a = tiny.build("opt", tmp_path / "a", seed=3)
    b = tiny.build("opt", tmp_path / "b", seed=3)
    c = tiny.build("opt", tmp_path / "c", seed=4)
    assert digest(a / "model.safetensors") == digest(b / "model.safetensors")
    assert digest(a / "tokenizer.json") == digest(b / "tokenizer.json")
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")


def test_tokenizer_round_trips_any_text(tiny_opt: Path, hh_file: Path):
    import gzip

    tokenizer = loading.load_tokenizer(str(tiny_opt))
    with gzip.open(hh_file, "rt", encoding="utf-8") as f:
        texts = [json.loads(next(f))["chosen"] for _ in range(20)]
    texts.append("Ünïcödé ✓ 中文 emoji 🙂")
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # The synthetic phrases were the training corpus: they compress well.
    phrase = " Happy to help! Cats sleep for most of the day."
    assert len(tokenizer(phrase, add_special_tokens=False)["input_ids"]) <= 12
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>"


def test_tiny_name_resolves_to_the_cache_and_builds_once(tiny_opt: Path):
    assert tiny_opt == tiny.cached_path("opt")
    assert str(tiny_opt).startswith(str(cache_root()))
    stamp = (tiny_opt / "model.safetensors").stat().st_mtime_ns
    assert Path(loading.resolve("tiny-opt")) == tiny_opt
    assert (tiny_opt / "model.safetensors").stat().st_mtime_ns == stamp


def test_generation_works_and_is_seeded(tiny_opt: Path):
    model = loading.load_causal_lm("tiny-opt")
    tokenizer = loading.load_tokenizer("tiny-opt")
    batch = tokenizer(["\n\nHuman: Hi\n\nAssistant:"], return_tensors="pt")
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(model.generate(**batch, do_sample=True, max_new_tokens=5, pad_token_id=tokenizer.pad_token_id))
    assert outs[0].shape[1] > batch["input_ids"].shape[1]
    assert torch.equal(outs[0], outs[1])


def test_missing_and_offline_models_are_clean_errors(tmp_path: Path):
    with pytest.raises(UserError, match="directory has no config.json"):
        loading.resolve(str(tmp_path))
    with pytest.raises(UserError, match=r"model ./nope: no such directory"):
        loading.resolve("./nope")
    with pytest.raises(UserError, match=r"^model no-org/no-model: cannot load tokenizer"):
        loading.load_tokenizer("no-org/no-model")


def test_remote_code_is_refused_unless_trusted(tiny_opt: Path, tmp_path: Path):
    import shutil

    custom = tmp_path / "custom"
    shutil.copytree(tiny_opt, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
        "AutoConfig": "modeling_evil.EvilConfig",
    }
    config["model_type"] = "kubealign-evil"  # not a transformers architecture: only its own code loads it
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "modeling_evil.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(UserError, match="trust_remote_code"):
        loading.load_causal_lm(str(custom))
    with pytest.raises(UserError, match="remote code ran"):
        loading.load_causal_lm(str(custom), trust_remote_code=True)


RANK_BUILDS = """
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from kubealign.models import tiny

rank, store, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=60))
if rank == 1:  # a torchrun rank other than 0 that wins the build lock
    tiny.build("opt", out)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_rank_other_than_0_builds_a_whole_model(tmp_path: Path):
    """transformers 5's save_pretrained writes nothing on a rank other than 0 once torch.distributed is
    initialized: the model rank 1 builds under torchrun must still have its config and weights, the same
    files a process outside any group writes."""
    import subprocess
    import sys

    out = tmp_path / "built-on-rank-1"
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_BUILDS, str(rank), str(tmp_path / "store"), str(out)])
        for rank in (0, 1)
    ]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    alone = tiny.build("opt", tmp_path / "alone")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert digest(out / name) == digest(alone / name), name
    assert loading.load_causal_lm(str(out)).config.architectures == ["OPTForCausalLM"]
