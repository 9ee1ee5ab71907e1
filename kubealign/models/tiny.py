"""Tiny models built locally from a config: no hub download, deterministic by seed.

`tiny-opt` and `tiny-llama` are 2-layer, width-128 causal LMs with a byte-level BPE tokenizer trained
by `tokenizers` on the built-in synthetic corpus. Byte-level BPE encodes any text (real data such as
HH-RLHF included) even though its merges were learned on the synthetic phrases. The Llama variant
uses as many KV heads as attention heads (no GQA), the layout DeepSpeed's kernel injection supports.

Built models are cached under $KUBEALIGN_CACHE_DIR (default ~/.cache/kubealign)/models and written
atomically, so concurrent builders never see a half-written directory.
"""

from __future__ import annotations

from pathlib import Path

from kubealign.config.cache import cache_root
from kubealign.data import synthetic
from kubealign.outputs import atomic_dir

ARCHS = ("opt", "llama")
TINY_NAMES = {f"tiny-{arch}": arch for arch in ARCHS}
VERSION = 2  # bump when the architecture, tokenizer or corpus changes: it names the cache dir
VOCAB_SIZE = 1024
HIDDEN = 128
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 512
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def cached_path(arch: str, seed: int = 0) -> Path:
    return cache_root() / "models" / f"tiny-{arch}-seed{seed}-v{VERSION}"


def train_tokenizer(seed: int):
    """A byte-level BPE tokenizer (transformers fast tokenizer) trained on the synthetic corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic.corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
    fast.model_max_length = MAX_POSITIONS
    return fast


def model_config(arch: str, tokenizer):
    """The transformers config of a tiny model of this architecture."""
    from transformers import LlamaConfig, OPTConfig

    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if arch == "opt":
        return OPTConfig(
            hidden_size=HIDDEN,
            word_embed_proj_dim=HIDDEN,
            ffn_dim=4 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            max_position_embeddings=MAX_POSITIONS,
            dropout=0.1,
            **ids,
        )
    if arch == "llama":
        return LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=False,
            **ids,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")


def build(arch: str, output: Path, seed: int = 0) -> Path:
    """Build a tiny model (weights from torch.manual_seed(seed)) and save it as a self-contained HF dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHS}")
    tokenizer = train_tokenizer(seed)
    config = model_config(arch, tokenizer)
    with torch.random.fork_rng(devices=[]):  # building must not reseed the caller's training RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with atomic_dir(output) as tmp:
        _save(model, tmp)
        tokenizer.save_pretrained(tmp)
    return output


def _save(model, directory: Path) -> None:
    """The model's config, generation config and weights, written by whichever process builds it.

    Not `model.save_pretrained`: with torch.distributed initialized, transformers 5 writes only on rank 0,
    so a torchrun rank other than 0 that won the build lock left a directory without config.json or
    weights (the cold-cache torchrun flake: the next process found it half written)."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # a tied head is stored once, under the embedding's name, as HF does
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def ensure(arch: str, seed: int = 0) -> Path:
    """The cached tiny model dir, built on first use. A file lock makes concurrent processes (the ranks
    of one torchrun job) wait for one builder instead of replacing the dir under each other."""
    from filelock import FileLock

    path = cached_path(arch, seed)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        if not (path / "config.json").exists():
            build(arch, path, seed)
    return path
