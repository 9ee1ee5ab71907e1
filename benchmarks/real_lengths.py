"""Padded against padding-free (length-grouped) batches at real lengths: HH-RLHF, an OPT-125M-shaped model.

The data is ../shared/data/hh-rlhf (harmless-base test, 2,312 dialogues) at DeepSpeed-Chat's lengths
(prompt + answer <= 512 tokens; PPO prompts <= 256), tokenized by a byte-level BPE of 16,384 tokens trained on
those dialogues (no hub here; on HH it gives the lengths GPT-2's BPE gives: random batches of 8 / 16 / 32 are
51 / 57 / 61 % padding, the figures issue 40 measured with GPT-2's). The model has OPT-125M's shape (12 layers,
width 768, vocabulary 50,272) with random weights. Settings come from configs/hh-real-lengths.yaml.

Each stage's pool is every usable pair. Per round and mode, the first micro-batches of an epoch plan over the
pool (a new seed each round) are trained, random batches padded to their longest (`batching: padded`) and
kubealign's length-grouped batches (`batching: grouped`), each mode on its own DeepSpeed engine built from
the same weights, with the stage's own collate and loss; rounds interleave the modes (the first alternates)
so that a change in the machine's load falls on both. Reported per stage:
real (non-padding) tokens per second of each, their ratio, the share of token slots (and so of the
token-linear FLOPs) spent on padding, and max_abs_diff: the largest difference between a sequence's
log-prob sum (reward: its score) computed in the padded batch and in the grouped one, before training.
"ppo" is the passes over rollouts: one no-grad forward (the experience pass, done per model) and one
training forward + backward of the actor, over prompts (left-padded) + answers (right-padded), in random
prompt batches against the stage's grouped prompt order (generation itself is not timed here).
dpo_initial_loss is DPO's loss in each grouped batch before any step, its reference's log-probs computed
in other (longest-first) batches: ln 2 = 0.693147 in every batch unless batching leaks between sequences.

  python benchmarks/real_lengths.py --quick     # 2 rounds of 1 step per mode and stage (under 10 min, 2 cores)
  python benchmarks/real_lengths.py             # 4 rounds of 2 steps
  python benchmarks/real_lengths.py --build-model   # only build build/models/opt-125m-hh (the preset's model)
  python benchmarks/real_lengths.py --quick --shape opt-1.3b   # on a GPU (bf16): docs/gpu.md, last and optional

The figures go to results/real-lengths-<label>.json; the last line printed is their JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from train_throughput import machine  # noqa: E402

HH = REPO.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
PRESET = REPO / "configs" / "hh-real-lengths.yaml"
MODELS = REPO / "build" / "models"
VOCAB = 16384
SHAPES = {  # facebook/opt-* config dimensions; the vocabulary is OPT's (the BPE uses its first 16,384 ids)
    "opt-125m": {
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "word_embed_proj_dim": 768,
    },
    "opt-1.3b": {
        "hidden_size": 2048,
        "ffn_dim": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "word_embed_proj_dim": 2048,
    },
}


def hh_dialogues() -> list[dict[str, str]]:
    with gzip.open(HH, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def build_model(shape: str = "opt-125m") -> Path:
    """build/models/SHAPE-hh: that OPT shape, random weights (seed 0), the HH-trained BPE. Built once;
    opt-125m-hh is the preset's model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, OPTConfig, PreTrainedTokenizerFast

    from kubealign.models.tiny import SPECIAL_TOKENS
    from kubealign.outputs import atomic_dir

    directory = MODELS / f"{shape}-hh"
    if (directory / "config.json").exists():
        return directory
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator((d[k] for d in hh_dialogues() for k in ("chosen", "rejected")), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)
    tokenizer.model_max_length = 2048
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = OPTConfig(**SHAPES[shape], vocab_size=50272, max_position_embeddings=2048, dropout=0.1, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(directory) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return directory


def encoded_pairs(tokenizer: Any, max_len: int) -> list[tuple[Any, Any]]:
    """Every usable HH pair, encoded as the loop stages encode them."""
    from kubealign.data import schemas
    from kubealign.data.tokenize import encode_preference

    pairs = []
    for row in hh_dialogues():
        try:
            p = schemas.normalize(row)
        except schemas.RowDrop:
            continue
        if p.chosen and p.rejected and p.chosen != p.rejected:
            pairs.append(encode_preference(tokenizer, p.prompt, p.chosen, p.rejected, max_len))
    return pairs


class Stage:
    """One stage's examples, collate, loss and per-sequence measure, as the stage module defines them."""

    def __init__(self, name: str, cfg: Any, examples: list[Any], collate: Any, loss: Any, measure: Any, length: Any):
        self.name, self.cfg, self.examples = name, cfg, examples
        self.collate, self.loss, self.measure, self.length = collate, loss, measure, length


def stages(config: Any, tokenizer: Any) -> dict[str, Stage]:
    from kubealign.data.tokenize import cut_left
    from kubealign.models.token_logprobs import forward_logits
    from kubealign.models.value_head import last_token_scores, token_values
    from kubealign.rl.losses import logprobs_from_logits
    from kubealign.stages import dpo, reward
    from kubealign.training import lm
    from kubealign.training.losses import bradley_terry_loss

    pad = tokenizer.pad_token_id
    pairs = encoded_pairs(tokenizer, config.sft.max_seq_len)
    sft_examples = [lm.example(c, False) for c, _ in pairs]

    def per_sequence_nll(model, batch):
        from kubealign.models.inputs import position_ids

        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids(batch["attention_mask"]),
            use_cache=False,
        ).logits
        logprobs = logprobs_from_logits(logits, batch["input_ids"])
        return -(logprobs * batch["loss_mask"][:, 1:]).sum(-1)

    dpo_examples = [
        {"index": i, "chosen": lm.example(c, False), "rejected": lm.example(r, False)} for i, (c, r) in enumerate(pairs)
    ]
    reward_examples = [(c.input_ids, r.input_ids) for c, r in pairs]

    def reward_loss(model, batch):
        return bradley_terry_loss(*reward.pair_scores(model, batch))

    def reward_measure(model, batch):
        return last_token_scores(
            token_values(model, batch["input_ids"], batch["attention_mask"]), batch["attention_mask"]
        )

    # The DPO step's own loss. The stage computes the reference's log-probs once, before the first step, as
    # a table (ReferenceTable); here the table is zeros (a step costs the same; dpo_initial_loss checks the
    # values with a real table), so timing needs no reference pass over the whole pool.
    table = dpo.ReferenceTable(dpo_examples, pad, 2 * config.dpo.micro_batch_size, contextlib.nullcontext)
    table.table = torch.zeros(len(dpo_examples), 2)
    dpo_train = dpo.train_loss(config.dpo, table, 1)

    def dpo_loss(model, batch):
        return dpo_train(model, batch).value

    def dpo_measure(model, batch):
        return dpo.response_logprobs(model, batch).total

    scale = config.sft.gradient_accumulation_steps
    prompt_cut = config.ppo.max_prompt_len
    bos = tokenizer.bos_token_id
    rollouts = [
        {"prompt": cut_left(c.input_ids[: c.prompt_len], prompt_cut, bos), "answer": c.input_ids[c.prompt_len :]}
        for c, _ in pairs
    ]

    def ppo_collate(rows):
        return rollout_batch(rows, pad)

    def ppo_loss(model, batch):
        with torch.no_grad():  # the experience pass (actor, reference, critic, reward: one forward each)
            forward_logits(model, batch["input_ids"], batch["attention_mask"])
        logits = forward_logits(model, batch["input_ids"], batch["attention_mask"])
        logprobs = logprobs_from_logits(logits, batch["input_ids"])
        mask = batch["loss_mask"][:, 1:]
        return -(logprobs * mask).sum() / mask.sum().clamp(min=1)

    def ppo_measure(model, batch):
        logits = forward_logits(model, batch["input_ids"], batch["attention_mask"])
        return (logprobs_from_logits(logits, batch["input_ids"]) * batch["loss_mask"][:, 1:]).sum(-1)

    return {
        "sft": Stage(
            "sft",
            config.sft,
            sft_examples,
            lambda b: lm.collate(b, pad),
            lambda m, b: lm.step_loss(lm.batch_loss(m, b, True), b, scale),
            lambda m, b: -per_sequence_nll(m, b),
            lambda e: len(e["input_ids"]),
        ),
        "reward": Stage(
            "reward",
            config.reward,
            reward_examples,
            lambda b: reward.collate(b, pad),
            reward_loss,
            reward_measure,
            reward.pair_length,
        ),
        "dpo": Stage(
            "dpo", config.dpo, dpo_examples, lambda b: dpo.collate(b, pad), dpo_loss, dpo_measure, dpo.pair_length
        ),
        "ppo": Stage("ppo", config.sft, rollouts, ppo_collate, ppo_loss, ppo_measure, lambda r: len(r["prompt"])),
    }


def rollout_batch(rows: list[dict[str, list[int]]], pad: int) -> dict[str, torch.Tensor]:
    """A rollout batch as the PPO stage lays it out: prompts left-padded to the longest, then the answers
    right-padded to the longest; loss_mask marks the answers."""
    from kubealign.data.tokenize import pad_batch

    prompts, prompt_mask = pad_batch([r["prompt"] for r in rows], pad, "left")
    answers, answer_mask = pad_batch([r["answer"] for r in rows], pad)
    ids = torch.cat([torch.tensor(prompts), torch.tensor(answers)], 1)
    attention = torch.cat([torch.tensor(prompt_mask), torch.tensor(answer_mask)], 1)
    loss_mask = torch.cat([torch.zeros_like(torch.tensor(prompt_mask)), torch.tensor(answer_mask)], 1)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def batches_of(stage: Stage, mode: str, seed: int, micro: int | None = None) -> list[list[int]]:
    """The micro-batches of an epoch of the stage's whole pool, as the loop would order them."""
    from kubealign.data import batching

    lengths = [stage.length(e) for e in stage.examples]
    micro = micro or (stage.cfg.micro_batch_size if stage.name != "ppo" else PPO_BATCH[0])
    return [b[0] for b in batching.epoch_plan(lengths, micro, 1, 1, seed, 0, mode)]


PPO_BATCH = [8]  # the ppo pass's rollout batch (ppo.generation_batch_size of the preset; set in main)


def load_model(stage: Stage, model_dir: Path) -> Any:
    from kubealign.models import loading
    from kubealign.stages.reward import load_reward_model

    if stage.name == "reward":
        return no_dropout(load_reward_model(str(model_dir), False, 1, "fp32", None))
    return no_dropout(loading.load_causal_lm(str(model_dir)))


def no_dropout(model: Any) -> Any:
    """Dropout off: every side must train the same function. OPT's dropout is functional (float attributes,
    not nn.Dropout modules): kubealign's PPO helper turns off both kinds."""
    from kubealign.rl.rollout import disable_dropout

    disable_dropout(model)
    return model


def engine_for(stage: Stage, model_dir: Path, steps: int) -> Any:
    from kubealign.training import engine as engines

    model = load_model(stage, model_dir)
    return engines.create(model, stage.cfg, engines.ds_config(stage.cfg, 1, torch.cuda.is_available()), steps)


def subset(stage: Stage, size: int) -> Stage:
    """The stage on `size` examples of its pool (those of its first grouped micro-batches: lengths vary)."""
    chosen = [i for b in batches_of(stage, "padded", seed=7) for i in b][:size]
    return Stage(
        stage.name,
        stage.cfg,
        [stage.examples[i] for i in chosen],
        stage.collate,
        stage.loss,
        stage.measure,
        stage.length,
    )


def differences(stage: Stage, model_dir: Path, size: int = 8) -> dict[str, float]:
    """The largest |per-sequence measure in a random padded batch - in a grouped batch| (absolute, and
    relative to the measure) over `size` examples, in batches of size / 2, before any step."""
    small = subset(stage, size)
    model = load_model(stage, model_dir).eval().to(distributed_device())
    found: dict[str, dict[Any, torch.Tensor]] = {}
    with torch.no_grad():
        for mode in ("padded", "grouped"):
            found[mode] = {}
            for batch in batches_of(small, mode, seed=7, micro=size // 2):
                values = small.measure(model, on_device(small.collate([small.examples[i] for i in batch])))
                rows = batch + batch if values.shape[0] == 2 * len(batch) else batch
                for k, i in enumerate(rows):
                    found[mode][(i, k >= len(batch))] = values[k]
        if stage.name == "sft":  # per-sequence NLL sums of the packed row, cut at the sequence boundaries
            found["packed"] = {}
            for batch in batches_of(small, "grouped", seed=7, micro=size // 2):
                nll = packed_nll(model, on_device(packed([small.examples[i] for i in batch])))[0]
                ends = torch.tensor([len(small.examples[i]["input_ids"]) for i in batch]).cumsum(0).tolist()
                for k, i in enumerate(batch):
                    start = ends[k - 1] if k else 0
                    found["packed"][(i, False)] = -nll[start : ends[k] - 1].sum()
    diffs = [(float((found["padded"][k] - v).abs()), float(v.abs())) for k, v in found["grouped"].items()]
    out = {
        "max_abs_diff": max(d for d, _ in diffs),
        "max_rel_diff": max(d / max(m, 1e-12) for d, m in diffs),
        "diff_examples": len(diffs),
    }
    if "packed" in found:
        out["packed_max_abs_diff"] = max(float((found["padded"][k] - v).abs()) for k, v in found["packed"].items())
    return out


def dpo_initial_loss(stage: Stage, model_dir: Path, pad: int, size: int = 16) -> list[float]:
    """DPO's loss in each grouped micro-batch of `size` examples before any step, the reference table
    computed in longest-first batches (ReferenceTable, as the stage does)."""
    from kubealign.stages import dpo

    stage = subset(stage, size)
    for i, example in enumerate(stage.examples):
        stage.examples[i] = {**example, "index": i}
    model = load_model(stage, model_dir).eval().to(distributed_device())
    table = dpo.ReferenceTable(stage.examples, pad, 2 * stage.cfg.micro_batch_size, contextlib.nullcontext)
    loss = dpo.train_loss(stage.cfg, table)
    engine = _Boundary(model)
    with torch.no_grad():
        return [
            float(loss(engine, on_device(stage.collate([stage.examples[i] for i in b]))).value)
            for b in batches_of(stage, "grouped", seed=7, micro=size // 4)
        ]


class _Boundary(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)

    def is_gradient_accumulation_boundary(self) -> bool:
        return True


def packed(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """SFT examples packed into one row: position ids restart at each sequence and a [1, 1, N, N] block-diagonal
    causal mask keeps attention inside each (transformers 5.23's OPT does not hand position ids to its mask
    builder, so position ids alone would let attention cross sequences: packed_max_abs_diff measured 3.4
    then); each sequence's first token is never a target (its loss-mask entry is 0)."""
    ids = [t for e in examples for t in e["input_ids"]]
    positions = [p for e in examples for p in range(len(e["input_ids"]))]
    segment = torch.tensor([k for k, e in enumerate(examples) for _ in e["input_ids"]])
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    blocks = (segment[:, None] == segment[None, :]) & causal
    mask = [0 if k == 0 else m for e in examples for k, m in enumerate(e["loss_mask"])]
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": torch.tensor([positions]),
        "blocks": blocks[None, None],
        "loss_mask": torch.tensor([mask]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
    }


def packed_nll(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1, N - 1] next-token NLL of a packed row, 0 where the loss mask is 0."""
    from kubealign.rl.losses import logprobs_from_logits

    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=batch["blocks"],
        use_cache=False,
    ).logits
    return -logprobs_from_logits(logits, batch["input_ids"]) * batch["loss_mask"][:, 1:]


def packed_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return packed_nll(model, batch).sum() / batch["step_units"]


def distributed_device() -> torch.device:
    from kubealign.training import distributed

    return distributed.device()


def on_device(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch's tensors on the training device. The stages' own losses move what they read (lm, reward,
    dpo); the PPO passes and the packed row here call the model directly, and on CUDA would hand it CPU ids."""
    device = distributed_device()
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def timed_pass(stage: Stage, engine: Any, batches: list[list[int]], pack: bool = False) -> dict[str, float]:
    """Train one micro-batch per optimizer step over `batches`; real tokens, token slots and seconds. On CUDA
    also the peak memory the steps added above what was allocated before them (the engines' weights and
    optimizer states stay resident between passes: this is the step's own activations and gradients)."""
    real = slots = 0
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for indices in batches:
        batch = on_device((packed if pack else stage.collate)([stage.examples[i] for i in indices]))
        if "loss_mask" in batch and stage.name == "sft":
            batch["step_units"] = torch.tensor(float(batch["loss_mask"][:, 1:].sum()))
        engine.backward((packed_loss if pack else stage.loss)(engine, batch))
        engine.step()
        real += int(batch["attention_mask"].sum())
        slots += batch["attention_mask"].numel()
    if cuda:
        torch.cuda.synchronize()  # the steps' kernels finished inside the timed span
    out = {"seconds": time.perf_counter() - started, "real_tokens": real, "slots": slots}
    if cuda:
        out["step_peak_bytes"] = torch.cuda.max_memory_allocated() - before
    return out


def measure(stage: Stage, model_dir: Path, rounds: int, steps: int) -> dict[str, Any]:
    """`rounds` interleaved rounds of `steps` optimizer steps per mode, each round's micro-batches the
    first of an epoch plan (a new seed per round) over the whole pool."""
    modes = ["padded", "grouped", *(["packed"] if stage.name == "sft" else [])]
    engines = {mode: engine_for(stage, model_dir, 10 * rounds * steps) for mode in modes}
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    if torch.cuda.is_available():  # one untimed step per mode first: CUDA's first kernels and allocations
        for mode in modes:  # took most of round 1 on the H200 (2.7 s against 0.2 s for the same step later)
            warm = batches_of(stage, "grouped" if mode == "packed" else mode, seed=99)[:1]
            timed_pass(stage, engines[mode], warm, pack=mode == "packed")
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            # packed: the grouped mode's micro-batches, each packed into one row
            batches = batches_of(stage, "grouped" if mode == "packed" else mode, seed=100 + r)[:steps]
            runs[mode].append(timed_pass(stage, engines[mode], batches, pack=mode == "packed"))
            print(f"  {stage.name} round {r + 1} {mode}: {runs[mode][-1]['seconds']:.1f} s", file=sys.stderr)
    # Freed before the next stage: `del` alone left every stage's engines (fp32 master weights and Adam
    # states of OPT-1.3B per mode) on the H200 until PPO's engines ran out of its 139 GiB.
    for engine in engines.values():
        engine.destroy()
    del engines
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out: dict[str, Any] = {}
    for mode, key in (("padded", "padded"), ("grouped", "padding_free")):
        real = sum(x["real_tokens"] for x in runs[mode])
        out[f"{key}_tokens_per_s"] = real / sum(x["seconds"] for x in runs[mode])
        out[f"{key}_padding_share"] = 1 - real / sum(x["slots"] for x in runs[mode])
        out[f"{key}_real_tokens"] = real
        out[f"{key}_round_s"] = [round(x["seconds"], 2) for x in runs[mode]]
        out[f"{key}_step_peak_bytes"] = max((x.get("step_peak_bytes", 0) for x in runs[mode]), default=0) or None
    out["speedup"] = out["padding_free_tokens_per_s"] / out["padded_tokens_per_s"]
    if "packed" in runs:  # the other padding-free mechanism, on this device
        seconds = sum(x["seconds"] for x in runs["packed"])
        out["packed_tokens_per_s"] = sum(x["real_tokens"] for x in runs["packed"]) / seconds
        out["packed_round_s"] = [round(x["seconds"], 2) for x in runs["packed"]]
        out["packed_step_peak_bytes"] = max(x.get("step_peak_bytes", 0) for x in runs["packed"]) or None
        out["packed_vs_grouped"] = out["packed_tokens_per_s"] / out["padding_free_tokens_per_s"]
    # what the padding shares alone predict: the same compute per slot, fewer slots per real token
    out["speedup_from_padding_share"] = (1 - out["padding_free_padding_share"]) / (1 - out["padded_padding_share"])
    out["pool"] = len(stage.examples)
    out["micro_batch_size"] = stage.cfg.micro_batch_size if stage.name != "ppo" else PPO_BATCH[0]
    out["steps_per_round"] = steps
    out["rounds"] = rounds
    # the share of slots that are padding in a whole epoch of each mode (not just the timed steps), as the
    # stage's collate lays the batches out (ppo: left-padded prompts, then right-padded answers)
    for mode, key in (("padded", "padded"), ("grouped", "padding_free")):
        masks = [stage.collate([stage.examples[i] for i in b])["attention_mask"] for b in batches_of(stage, mode, 100)]
        out[f"{key}_epoch_padding_share"] = 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)
    out.update(differences(stage, model_dir))
    return out


def main() -> None:
    global HH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step per mode and stage")
    parser.add_argument("--stages", nargs="+", default=["sft", "reward", "dpo", "ppo"])
    parser.add_argument("--steps", type=int, help="optimizer steps per mode per round (default 2; --quick 1)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 4; --quick 2)")
    parser.add_argument("--build-model", action="store_true", help="only build the model and exit")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="opt-125m", help="the model's OPT shape")
    parser.add_argument("--hh", type=Path, default=HH, help="the HH-RLHF file (default: ../shared/data/hh-rlhf's)")
    parser.add_argument("--label", help="results file suffix (default: cpu-2core or quick-cpu)")
    args = parser.parse_args()
    if not args.hh.exists():
        raise SystemExit(f"{args.hh}: absent (../shared/data beside the repo, or --hh FILE)")
    HH = args.hh
    model_dir = build_model(args.shape)
    if args.build_model:
        print(model_dir)
        return
    from kubealign.config import load_config
    from kubealign.models import loading
    from kubealign.training import distributed

    distributed.init()  # one rank, as a stage run alone (DeepSpeed needs the process group)
    # on CUDA the stages train in bf16 (the GPU presets' precision); on CPU in the preset's fp32
    config = load_config(
        PRESET, [f"{s}.dtype=bf16" for s in ("sft", "reward", "dpo")] if torch.cuda.is_available() else []
    )
    PPO_BATCH[0] = config.ppo.generation_batch_size
    tokenizer = loading.load_tokenizer(str(model_dir))
    steps = args.steps or (1 if args.quick else 2)
    rounds = args.rounds or (2 if args.quick else 4)
    found = stages(config, tokenizer)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    device = "gpu" if torch.cuda.is_available() else "cpu"
    label = args.label or f"{args.shape}-{'quick-' if args.quick else ''}{device}"
    losses: list[float] = []

    def record() -> dict[str, Any]:  # rewritten after every stage: a run cut short keeps what it measured
        summary = {
            "stages": results,
            "dpo_initial_loss": max(losses, key=lambda x: abs(x - math.log(2))) if losses else None,
            "dpo_initial_loss_per_batch": losses,
            "wall_s": time.perf_counter() - started,
        }
        whole = {
            "result": summary,
            "machine": machine(),
            "command": " ".join(["python", *sys.argv]),
            "model": f"{args.shape} shape, random weights, HH-trained BPE (16384)",
            "data": str(HH.name),
        }
        (HERE / "results" / f"real-lengths-{label}.json").write_text(json.dumps(whole, indent=2) + "\n")
        return summary

    for name in args.stages:
        results[name] = measure(found[name], model_dir, rounds, steps)
        print(f"{name}: {results[name]['speedup']:.2f}x", file=sys.stderr)
        record()
    losses = dpo_initial_loss(found["dpo"], model_dir, tokenizer.pad_token_id) if "dpo" in args.stages else []
    print(json.dumps(record()))


if __name__ == "__main__":
    main()
