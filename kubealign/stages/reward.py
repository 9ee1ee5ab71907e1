"""Stage 2, reward: a reward model trained on phase-2 (prompt, chosen, rejected) pairs.

The reward model is a transformer with a scalar head (transformers' AutoModelForSequenceClassification,
num_labels=1, so the saved dir reloads with plain transformers). The head gives a value per token;
the score of a sequence is the value at its last non-pad token (the EOS that ends every response that
fits; the last kept token of one cut for length), whatever the padding side. The PPO stage loads the
same dir as critic (per-token values) and reward (sequence score). Loss: Bradley-Terry on sequence
scores (see training.losses.bradley_terry_loss).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from kubealign import ranks
from kubealign.config import KubealignConfig
from kubealign.data import phases
from kubealign.data.split import HELDOUT, PEOPLE
from kubealign.data.tokenize import encode_preference, pad_batch
from kubealign.models.value_head import last_token_scores, load_reward_model, token_values
from kubealign.outputs import check_output_path, output_stage, read_result
from kubealign.tracking.lineage import phase_ref
from kubealign.training import distributed, loop, stage
from kubealign.training.engine import apply_lora, ds_config, zero3_loading
from kubealign.training.losses import bradley_terry_loss

STAGE = "reward"
SCORES_FILE = "eval_scores.json"


def tokenize(rows: Any, tokenizer: Any, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) per pair, one prompt cut once for both (data.tokenize.encode_preference)."""
    pairs = []
    for p, c, r in zip(rows["prompt"], rows["chosen"], rows["rejected"], strict=True):
        chosen, rejected = encode_preference(tokenizer, p, c, r, max_len)
        pairs.append((chosen.input_ids, rejected.input_ids))
    return pairs


def collate(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then rejected ones, in one right-padded batch (2B rows)."""
    ids, mask = pad_batch([c for c, _ in pairs] + [r for _, r in pairs], pad_id)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def pair_length(pair: tuple[list[int], list[int]]) -> int:
    """What a pair pads to: its longer response's sequence (both are in one batch, collate)."""
    return max(len(pair[0]), len(pair[1]))


def pair_scores(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = distributed.device()
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    scores = last_token_scores(token_values(model, ids, mask), mask)
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def evaluate(engine: Any, pairs: list[Any], pad_id: int, batch_size: int) -> tuple[dict[str, float], dict]:
    """Accuracy (chosen > rejected), mean scores and margin over all ranks, plus ROC data on rank 0."""
    import torch.distributed as dist
    from sklearn.metrics import roc_auc_score, roc_curve

    engine.eval()
    chosen_all: list[float] = []
    rejected_all: list[float] = []
    with torch.no_grad():
        for batch, weight in loop.shard_batches(pairs, batch_size, dist.get_rank(), dist.get_world_size(), pair_length):
            chosen, rejected = pair_scores(engine, collate(batch, pad_id))
            if weight:
                chosen_all += chosen.float().tolist()
                rejected_all += rejected.float().tolist()
    engine.train()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (chosen_all, rejected_all))
    chosen_all = [s for c, _ in gathered for s in c]
    rejected_all = [s for _, r in gathered for s in r]
    n = max(len(chosen_all), 1)
    labels = [1] * len(chosen_all) + [0] * len(rejected_all)
    scores = chosen_all + rejected_all
    fpr, tpr, thresholds = roc_curve(labels, scores)
    metrics = {
        "accuracy": sum(c > r for c, r in zip(chosen_all, rejected_all, strict=True)) / n,
        "chosen_mean": sum(chosen_all) / n,
        "rejected_mean": sum(rejected_all) / n,
        "margin_mean": sum(c - r for c, r in zip(chosen_all, rejected_all, strict=True)) / n,
        "auc": float(roc_auc_score(labels, scores)),
    }
    roc = {
        "labels": labels,
        "scores": scores,
        "fpr": fpr.tolist(),
        "tpr": tpr.tolist(),
        "thresholds": [float(t) if abs(t) != float("inf") else None for t in thresholds],
    }
    return metrics, roc


def people_agreement(accuracy: float, pairs: int) -> dict[str, float]:
    """people_agreement (the share of people's kept-out pairs the model scores their choice higher on; a tie is not
    agreeing), its Wilson 95 % interval (_low, _high) and _n: what kubealign.feedback.fresh hands the gate."""
    from kubealign.feedback.annotations import wilson

    agreed = round(accuracy * pairs)
    low, high = wilson(agreed, pairs)
    return {
        "people_agreement": agreed / pairs,
        "people_agreement_low": low,
        "people_agreement_high": high,
        "people_agreement_n": float(pairs),
    }


def run(
    config: KubealignConfig,
    data: Path,
    model_name: str | None,
    output: Path,
    resume: bool = False,
    checkpoint_location: Path | None = None,
) -> dict:
    """Train a reward model from `model_name` (default: reward.model) on DATA's phase 2; when phase 2 holds a
    heldout split (data.heldout_reward_fraction), first the held-out reward model on it, into OUTPUT/heldout."""
    cfg = config.reward if model_name is None else config.reward.model_copy(update={"model": model_name})
    check_output_path(output, STAGE)  # before the held-out model's training, not after it
    dataset = phases.load(data, "phase2_reward", need_rejected=True)  # read once for both models
    heldout = train_heldout(config, cfg, dataset, output, resume, checkpoint_location)
    extra = {} if heldout is None else {f"{HELDOUT}/{k}": v for k, v in heldout.items() if isinstance(v, float | int)}
    ref = phase_ref(data, "phase2_reward", "training")
    result = train(config, cfg, lambda: dataset, output, resume, checkpoint_location, extra, ref)
    if heldout is not None and ranks.is_main():
        os.replace(heldout_sibling(output), output / HELDOUT)  # one rename: the directory is whole or absent
    return result


def heldout_sibling(output: Path) -> Path:
    """Where the held-out reward model is trained, beside OUTPUT (whose export replaces OUTPUT whole)."""
    return Path(f"{output}.{HELDOUT}")


def train_heldout(
    config: KubealignConfig, cfg: Any, dataset: Any, output: Path, resume: bool, location: Path | None
) -> dict[str, Any] | None:
    """The held-out reward model (the independent scorer): the same recipe on phase 2's heldout pairs,
    evaluated on the same eval pairs, not tracked as a run of its own (its metrics join the main run's as
    heldout/*). None when phase 2 has no heldout split. A resumed task reuses one that was finished."""
    if HELDOUT not in dataset or len(dataset[HELDOUT]) == 0:
        return None
    sibling = heldout_sibling(output)
    if resume and output_stage(sibling) == STAGE:
        return read_result(sibling)["metrics"]
    if ranks.is_main():
        print(f"reward: the held-out reward model first, on {len(dataset[HELDOUT])} reserved pairs", flush=True)
    import datasets

    # people's kept-out pairs check it too: it never trains on a `phase: reward` source's pairs (split rules 5 and 6)
    people = {PEOPLE: dataset[PEOPLE]} if PEOPLE in dataset else {}
    pairs = datasets.DatasetDict({"train": dataset[HELDOUT], "eval": dataset["eval"], **people})
    untracked = config.model_copy(update={"tracking": config.tracking.model_copy(update={"enabled": False})})
    where = None if location is None else location.with_name(f"{location.name}-{HELDOUT}")
    return train(untracked, cfg, lambda: pairs, sibling, resume, where)["metrics"]


def train(
    config: KubealignConfig,
    cfg: Any,
    load: Any,
    output: Path,
    resume: bool,
    checkpoint_location: Path | None,
    extra: dict[str, float] | None = None,
    data: Any = None,
) -> dict:
    """One reward model on load()'s train pairs; `extra`: metrics to log with its own (the held-out model's);
    `data`: the lineage.DatasetRef of the pairs (the run's dataset input)."""

    def build(dataset: Any, tokenizer: Any, world: int, tracker: Any) -> stage.Built:
        from transformers import AutoModelForSequenceClassification

        train = tokenize(dataset["train"], tokenizer, cfg.max_seq_len)
        evals = tokenize(dataset["eval"], tokenizer, cfg.max_seq_len)
        people = tokenize(dataset[PEOPLE], tokenizer, cfg.max_seq_len) if PEOPLE in dataset else []
        with zero3_loading(ds_config(cfg, world, torch.cuda.is_available())):
            pad = tokenizer.pad_token_id
            model = load_reward_model(cfg.model, cfg.trust_remote_code, pad, cfg.dtype, cfg.revision)
            model = apply_lora(model, cfg.lora, "SEQ_CLS")
        pad = tokenizer.pad_token_id

        def evaluate_with_roc(engine: Any) -> loop.Evaluation:
            metrics, roc = evaluate(engine, evals, pad, cfg.micro_batch_size)
            if people:  # the check against people on their pairs it never trained on (data.people_check_fraction)
                checked, _ = evaluate(engine, people, pad, cfg.micro_batch_size)
                metrics.update(people_agreement(checked["accuracy"], len(people)))
            return loop.Evaluation(metrics, {SCORES_FILE: roc})

        return stage.Built(
            model=model,
            train=train,
            evals=evals,
            collate=lambda b: collate(b, pad),
            loss=lambda engine, batch: bradley_terry_loss(*pair_scores(engine, batch)),
            evaluate=evaluate_with_roc,
            model_cls=AutoModelForSequenceClassification,
            task_type="SEQ_CLS",
            result={"train_pairs": len(train), "eval_pairs": len(evals)},
            length=pair_length,
            metrics=dict(extra or {}),
        )

    outputs = {"eval_scores": SCORES_FILE, **({HELDOUT: HELDOUT} if extra else {})}
    return stage.run(STAGE, config, cfg, load, build, output, resume, checkpoint_location, outputs, data)
