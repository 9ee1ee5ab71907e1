"""kubealign against TRL at real lengths: SFT, reward, DPO and GRPO on HH-RLHF, an OPT-125M-shaped model.

GRPO (whole iterations: generation, experience, update) is benchmarks/trl_grpo.py, run from here with
`--stages grpo` (its docstring says how); what follows is about the three token-linear stages.

Both sides get the same model (build/models/opt-125m-hh, random weights, dropout off), the same tokens
(kubealign's encoding of every usable HH pair at 512 tokens, handed to TRL pre-tokenized), the same micro-batch
(the preset's 8, one micro-batch per optimizer step), learning rate, fp32 and gradient clipping. Each round
builds every side afresh from those weights and trains `steps` optimizer steps on the same examples: those of
kubealign's first `steps` grouped micro-batches of an epoch plan over the whole pool (a new seed each round),
which each side batches its own way. Rounds interleave the sides (the order reverses every round) so a change
in the machine's load falls on all. The sides:

- kubealign: the stage's own collate and loss on a DeepSpeed engine, `batching: grouped` (its default).
- trl: TRL's trainer at its best on this device: length-grouped batches, here kubealign's very micro-batches
  in order (a sequential sampler over them), and activation checkpointing off (as kubealign's preset has it;
  TRL turns it on by default to save memory, at the cost of a second forward). Hugging Face's own
  `train_sampling_strategy="group_by_length"` groups the same way over a whole epoch (windows of 50 batches
  sorted by length) but not over the few examples a round trains (its windows are min(n // (4 x batch), 50)
  batches, at least one: one batch, so random batches, below 64 examples at a batch of 8), so the batches are
  handed over instead.
- trl-default: TRL as it comes (random batches padded to their longest, activation checkpointing on: TRL's
  configs default to it): what a run that sets neither gets.
- trl-padding-free (sft only): TRL's padding_free=True (sequences flattened into one row, position ids
  restarting), checkpointing off. It needs attention that follows the position ids (flash-attention's
  varlen kernels); with this model's SDPA attention it is not exact, and `exact` says so: it is timed, never
  the "best" TRL.

Reported per stage and side: real (non-padding) tokens per second over the timed steps (from the trainer's
start of training, its optimizer and model already built, to the end of the last step; the tokens of the
batches trained, so a DPO pair counts its prompt twice on both sides although kubealign's forward runs it
once: models.shared_prompt), the share of token
slots spent on padding, the loss of every step, the peak resident memory the timed steps added
(`peak_rss_above_start_mib`: the process's peak reset when a side's timed steps start, the largest over the
rounds; Linux), and `same_loss`: kubealign's loss and TRL's on one identical
micro-batch before any step (SFT: the token mean of the completion NLL; DPO: the sigmoid loss, both against
the same zero reference table; reward: not comparable, TRL trains a sequence-classification head and
kubealign a value head). `speedup` is kubealign's throughput over the best exact TRL side's.

DPO's reference log-probs are a table computed once before training on both sides (kubealign's
ReferenceTable, TRL's precompute_ref_log_probs); both get a table of zeros here, so no side pays for it and
the timed steps are the policy's forward and backward on chosen + rejected.

  make bench-trl                                        # the venv with TRL (.venv-trl), then --quick
  .venv-trl/bin/python benchmarks/trl_compare.py --quick  # 2 rounds of 1 step
  .venv-trl/bin/python benchmarks/trl_compare.py          # 3 rounds of 2 steps (sft, reward, dpo)
  .venv-trl/bin/python benchmarks/trl_compare.py --stages grpo --rounds 2 --label opt-125m-grpo-cpu

The figures go to results/trl-compare-<label>.json; the last line printed is their JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import PrinterCallback

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import real_lengths as rl  # noqa: E402
import trl_grpo  # noqa: E402
from train_throughput import machine  # noqa: E402
from trl_common import Counter, alone, trl_callback  # noqa: E402

SIDES = {
    "sft": ["kubealign", "trl", "trl-default", "trl-padding-free"],
    "reward": ["kubealign", "trl", "trl-default"],
    "dpo": ["kubealign", "trl", "trl-default"],
    "grpo": ["kubealign", "trl"],
}


def trl_dataset(stage: rl.Stage) -> Any:
    """The stage's pool as TRL's trainers take it pre-tokenized."""
    from datasets import Dataset

    if stage.name == "sft":
        rows = [{"input_ids": e["input_ids"], "completion_mask": e["loss_mask"]} for e in stage.examples]
    elif stage.name == "reward":
        rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in stage.examples]
    else:  # dpo: the shared prompt, then each response
        rows = []
        for pair in stage.examples:
            chosen, rejected = pair["chosen"]["input_ids"], pair["rejected"]["input_ids"]
            cut = pair["chosen"]["loss_mask"].index(1)
            rows.append({"prompt_ids": chosen[:cut], "chosen_ids": chosen[cut:], "rejected_ids": rejected[cut:]})
    return Dataset.from_list(rows)


def trl_trainer(stage: rl.Stage, side: str, model_dir: Path, data: Any, seed: int, steps: int, out: str) -> Any:
    """TRL's trainer for the stage and side, its model loaded from model_dir with dropout off."""
    import trl
    from transformers import AutoModelForSequenceClassification

    cfg = stage.cfg
    common = dict(
        output_dir=out,
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=1,
        learning_rate=cfg.learning_rate,
        max_steps=steps,
        seed=seed,
        data_seed=seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available(),
        max_grad_norm=cfg.gradient_clipping,
        dataloader_num_workers=0,
        train_sampling_strategy="random" if side == "trl-default" else "sequential",
        # TRL's configs turn activation checkpointing on (a forward recomputed in every backward, to save
        # memory); the preset has it off and 24 GiB hold the model: off, except where TRL runs as it comes
        gradient_checkpointing=side == "trl-default",
    )
    from kubealign.models import loading

    tokenizer = loading.load_tokenizer(str(model_dir))
    if stage.name == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
        rl.no_dropout(model)
        args = trl.RewardConfig(**common, max_length=cfg.max_seq_len)
        return trl.RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    model = rl.load_model(stage, model_dir)
    if stage.name == "sft":
        free = side == "trl-padding-free"
        args = trl.SFTConfig(
            **common, padding_free=free, max_length=None if free else cfg.max_seq_len, completion_only_loss=True
        )
        return trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    args = trl.DPOConfig(**common, beta=cfg.beta, max_length=cfg.max_seq_len, precompute_ref_log_probs=True)
    return _dpo_class()(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def _dpo_class() -> type:
    import trl

    class PretokenizedDPO(trl.DPOTrainer):
        """TRL's DPOTrainer on kubealign's tokens (its own tokenization skipped) with a zero reference table."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

        def _precompute_ref_logps(self, dataset, name, batch_size):
            zeros = [0.0] * len(dataset)
            return dataset.add_column("ref_chosen_logps", zeros).add_column("ref_rejected_logps", zeros)

    return PretokenizedDPO


def run_trl(stage: rl.Stage, side: str, model_dir: Path, data: Any, seed: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out, alone():
        trainer = trl_trainer(stage, side, model_dir, data, seed, steps, out)
        counter = Counter(trainer.model)
        trainer.remove_callback(PrinterCallback)  # quiet: the losses are kept by the counter
        trainer.add_callback(trl_callback(counter))
        trainer.train()
    return {**counter.figures(), "losses": counter.losses}


def run_kubealign(stage: rl.Stage, model_dir: Path, seed: int, steps: int) -> dict[str, Any]:
    """`steps` optimizer steps of the stage's grouped micro-batches (an epoch plan with this seed)."""
    engine = rl.engine_for(stage, model_dir, steps)
    counter = Counter(None)  # the batches' tokens (Counter.add): DPO's forwards see each prompt once
    counter.mark()
    for indices in rl.batches_of(stage, "grouped", seed)[:steps]:
        batch = collate(stage, indices)
        counter.add(batch["attention_mask"])
        loss = stage.loss(engine, batch)
        engine.backward(loss)
        engine.step()
        counter.losses.append(loss.item())
        counter.mark()
    del engine
    return {**counter.figures(), "losses": counter.losses}


def collate(stage: rl.Stage, indices: list[int]) -> dict[str, torch.Tensor]:
    """kubealign's micro-batch of those examples (one micro-batch a step: SFT's step_units are its own)."""
    batch = stage.collate([stage.examples[i] for i in indices])
    if stage.name == "sft":
        batch["step_units"] = torch.tensor(float(batch["loss_mask"][:, 1:].sum()))
    return batch


def same_loss(stage: rl.Stage, model_dir: Path, data: Any, side: str = "trl") -> dict[str, float]:
    """kubealign's loss and TRL's (the given side's collate) on the first grouped micro-batch, before any step."""
    if stage.name == "reward":
        return {}
    indices = rl.batches_of(stage, "grouped", 100)[0]
    with tempfile.TemporaryDirectory() as out, torch.no_grad(), alone():
        trainer = trl_trainer(stage, side, model_dir, data, 100, 1, out)
        model = trainer.model.eval()
        ours = float(stage.loss(rl._Boundary(model), collate(stage, indices)))
        # the trainer's own rows (its dataset preparation adds columns: SFT's labels), one per pool example
        if len(trainer.train_dataset) != len(stage.examples):
            raise RuntimeError(f"TRL kept {len(trainer.train_dataset)} of the {len(stage.examples)} examples")
        rows = [trainer.train_dataset[i] for i in indices]
        theirs = float(trainer.compute_loss(model, trainer.data_collator(rows)))
    return {"kubealign": ours, "trl": theirs, "abs_diff": abs(ours - theirs)}


def measure(stage: rl.Stage, model_dir: Path, rounds: int, steps: int, sides: list[str]) -> dict[str, Any]:
    data = trl_dataset(stage)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(rounds):
        seed = 100 + r
        # every side trains the same examples: those of kubealign's first `steps` micro-batches this round, in
        # their order (TRL's grouped sides read them sequentially; trl-default draws random batches of them)
        chosen = [i for b in rl.batches_of(stage, "grouped", seed)[:steps] for i in b]
        for side in sides if r % 2 == 0 else sides[::-1]:
            found = (
                run_kubealign(stage, model_dir, seed, steps)
                if side == "kubealign"
                else run_trl(stage, side, model_dir, data.select(chosen), seed, steps)
            )
            runs[side].append(found)
            print(f"  {stage.name} round {r + 1} {side}: {found['seconds']:.1f} s", file=sys.stderr)
    out: dict[str, Any] = {
        "pool": len(stage.examples),
        "micro_batch_size": stage.cfg.micro_batch_size,
        "steps_per_round": steps,
        "rounds": rounds,
        "sides": {},
    }
    for side, found in runs.items():
        real = sum(x["real_tokens"] for x in found)
        out["sides"][side] = {
            "tokens_per_s": real / sum(x["seconds"] for x in found),
            "padding_share": 1 - real / sum(x["slots"] for x in found),
            "round_s": [round(x["seconds"], 2) for x in found],
            "losses": [[round(v, 5) for v in x["losses"]] for x in found],
        }
        peaks = [x["peak_rss_above_start_bytes"] for x in found if "peak_rss_above_start_bytes" in x]
        if peaks:  # the largest over the rounds: resident memory the timed steps added at their peak
            out["sides"][side]["peak_rss_above_start_mib"] = round(max(peaks) / 2**20, 1)
    if "trl" not in sides:  # a kubealign-only run: nothing to compare with
        return out
    out["same_loss"] = same_loss(stage, model_dir, data)
    if "trl-padding-free" in sides:
        check = same_loss(stage, model_dir, data, "trl-padding-free")
        # exact: TRL's padding-free loss equals its own padded loss on the same micro-batch
        pf = out["sides"]["trl-padding-free"]
        pf["loss_abs_diff_vs_padded"] = abs(check["trl"] - out["same_loss"]["trl"])
        pf["exact"] = pf["loss_abs_diff_vs_padded"] < 1e-4
    exact = [s for s in sides if s.startswith("trl") and out["sides"][s].get("exact", True)]
    best = max(exact, key=lambda s: out["sides"][s]["tokens_per_s"])
    out["best_trl"] = best
    out["speedup"] = out["sides"]["kubealign"]["tokens_per_s"] / out["sides"][best]["tokens_per_s"]
    return out


def quiet() -> None:
    import datasets
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's configs set a renamed argument
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")  # accelerate's note on threads
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step per side and stage")
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["sft", "reward", "dpo"],
        choices=list(SIDES),
        help="default: sft reward dpo (grpo: whole PPO-stage iterations, run on its own)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per side per round (default 2; --quick 1)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; --quick 2)")
    parser.add_argument("--label", help="results file suffix (default: opt-125m-cpu or opt-125m-quick-cpu)")
    parser.add_argument(
        "--sides",
        nargs="+",
        help="only these sides (e.g. kubealign: one library's figure against another commit's, same machine); "
        "no speedup is computed without a TRL side",
    )
    args = parser.parse_args()
    try:
        import trl
    except ImportError:
        print(
            "trl_compare.py: TRL is not installed in this Python; `make bench-trl` builds .venv-trl with it",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    if not rl.HH.exists():
        print(f"trl_compare.py: {rl.HH}: absent (../shared/data beside the repo)", file=sys.stderr)
        raise SystemExit(2)
    quiet()
    model_dir = rl.build_model()
    from kubealign.config import load_config
    from kubealign.models import loading
    from kubealign.training import distributed

    distributed.init()
    config = load_config(rl.PRESET, [])
    tokenizer = loading.load_tokenizer(str(model_dir))
    steps, rounds = args.steps or (1 if args.quick else 2), args.rounds or (2 if args.quick else 3)
    found = rl.stages(config, tokenizer)
    started = time.perf_counter()
    results = {}
    for name in args.stages:
        if name == "grpo":  # whole iterations of the ppo stage: trl_grpo.py
            results[name] = trl_grpo.measure(model_dir, config, tokenizer, rounds, steps)
        else:
            sides = [s for s in SIDES[name] if not args.sides or s in args.sides]
            results[name] = measure(found[name], model_dir, rounds, steps, sides)
        if "speedup" in results[name]:
            print(f"{name}: {results[name]['speedup']:.2f}x {results[name]['best_trl']}", file=sys.stderr)
    summary = {"stages": results, "wall_s": time.perf_counter() - started, "trl": trl.__version__}
    label = args.label or f"opt-125m-{'quick-' if args.quick else ''}{'gpu' if torch.cuda.is_available() else 'cpu'}"
    record = {
        "result": summary,
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "model": "opt-125m shape, random weights, HH-trained BPE (16384)",
        "data": rl.HH.name,
    }
    (HERE / "results" / f"trl-compare-{label}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
