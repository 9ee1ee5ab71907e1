"""The dpo route: Direct Preference Optimization (Rafailov et al. 2023) on phase-2 preference pairs.

The policy starts from `dpo.model` (the sft stage's output in the DAG) and is trained on DeepSpeed by the
same loop as sft and reward (ZeRO 0-3, LoRA, checkpoints, exact --resume, the NaN stop). The reference is
the starting weights, frozen: a second, frozen copy for full fine-tuning (partitioned by a DeepSpeed engine
at ZeRO-3, as PPO's reference), and with LoRA the same module with its adapters disabled (PEFT
disable_adapter), so no second copy exists — which is why LoRA here needs `dpo.lora.only_lora`.
Loss and metrics: kubealign.rl.dpo. Output: an HF causal-LM dir (adapters merged) that evaluate and
promote take as a candidate exactly like a PPO output, and result.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kubealign.config import KubealignConfig
from kubealign.config.schema import DPOConfig
from kubealign.data import phases
from kubealign.data.tokenize import encode_preference
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.models.shared_prompt import pair_target_logprobs
from kubealign.models.token_logprobs import first_target_column, forward_logits
from kubealign.rl.dpo import (
    SequenceLogprobs,
    chosen_nll,
    dpo_loss,
    pair_logprobs,
    reward_metrics,
    sequence_logprobs,
    sequence_sums,
    token_kl,
)
from kubealign.rl.rollout import disable_dropout
from kubealign.tracking.lineage import phase_ref
from kubealign.training import distributed, lm, loop, stage
from kubealign.training import engine as engines

STAGE = "dpo"
log = logging.getLogger(__name__)


def tokenize(rows: Any, tokenizer: Any, max_len: int) -> list[dict[str, Any]]:
    """Pairs in the one sequence convention (data.tokenize.encode_preference: one prompt cut once for
    both responses, masked; the responses as targets, EOS only where they were not cut)."""
    pairs = []
    for i, (p, c, r) in enumerate(zip(rows["prompt"], rows["chosen"], rows["rejected"], strict=True)):
        chosen, rejected = encode_preference(tokenizer, p, c, r, max_len)
        pairs.append({"index": i, "chosen": lm.example(chosen, False), "rejected": lm.example(rejected, False)})
    return pairs


def collate(pairs: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen sequences first, then the rejected ones, in one right-padded batch of 2B rows (one forward)."""
    batch = lm.collate([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], pad_id)
    batch["index"] = torch.tensor([p["index"] for p in pairs])
    return batch


def pair_length(pair: dict[str, Any]) -> int:
    """What a pair pads to: its longer sequence (chosen and rejected are in one batch, collate)."""
    return max(len(pair["chosen"]["input_ids"]), len(pair["rejected"]["input_ids"]))


def response_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> SequenceLogprobs:
    """Summed log-probs of each row's response tokens (a collated pair batch), each pair's prompt run once
    (models.shared_prompt) and the LM head and the log-softmax at the response tokens only
    (models.token_logprobs): the policy's in training and the reference table's."""
    device = distributed.device()
    ids, attention, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
    return sequence_sums(pair_target_logprobs(model, ids, attention, mask), mask)


def _forward(model: Any, batch: dict[str, torch.Tensor]) -> tuple[SequenceLogprobs, torch.Tensor, int]:
    """(response log-probs, logits, first) with the full logits of positions first.. (first: the first
    column any row's response occupies), for evaluate's exact KL, which needs every token's probability."""
    device = distributed.device()
    ids, attention, mask = (batch[k].to(device) for k in ("input_ids", "attention_mask", "loss_mask"))
    first = first_target_column(mask[:, 1:])
    logits = forward_logits(model, ids, attention, first)
    return sequence_logprobs(logits, ids[:, first:], mask[:, first:]), logits, first


def first_half(seq: SequenceLogprobs) -> SequenceLogprobs:
    """The chosen rows of a collated batch."""
    n = seq.total.shape[0] // 2
    return SequenceLogprobs(seq.total[:n], seq.tokens[:n])


def halves(seq: SequenceLogprobs, loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    logps = pair_logprobs(seq, loss_type)
    return logps[: logps.shape[0] // 2], logps[logps.shape[0] // 2 :]


@contextlib.contextmanager
def reference_view(engine: Any, frozen: Any) -> Iterator[Any]:
    """What computes the reference's forward: the frozen copy, or (LoRA, frozen None) the policy engine
    itself with its adapters disabled and in eval mode. The engine, not its module: under ZeRO-3 its
    hooks gather the partitioned parameters."""
    if frozen is not None:
        yield frozen
        return
    module = engine.module
    training = module.training
    module.eval()
    try:
        with module.disable_adapter():
            yield engine
    finally:
        module.train(training)


class ReferenceTable:
    """The reference's summed log-probs of every train sequence, computed once, at the first loss call.

    The reference never changes, so its log-probs of a train pair are constants: computed once they cost
    one forward per pair instead of one per pair per epoch, and a training step then costs what an SFT step
    does (TRL's `precompute_ref_log_probs`). They are computed inside the loop (first loss call, the same
    moment on every rank) rather than before it, because with LoRA at ZeRO-3 the reference is the training
    engine itself. Each rank computes its share (loop.shard_batches: equal batch counts, as ZeRO-3's
    collective forwards need) and all ranks gather the whole table. A resumed run recomputes it: the
    reference and the eval-mode forward are deterministic, so it gets the same values."""

    def __init__(self, examples: list[dict[str, Any]], pad: int, batch_size: int, view: Callable[[Any], Any]):
        self.examples, self.pad, self.batch_size, self.view = examples, pad, batch_size, view
        self.table: torch.Tensor | None = None  # [N, 2]: chosen, rejected

    def lookup(self, engine: Any, index: torch.Tensor) -> torch.Tensor:
        """[2B] reference log-probs of the batch with these pair indices: chosen rows, then rejected."""
        if self.table is None:
            self.table = self.compute(engine)
        rows = self.table[index.cpu()]
        return torch.cat([rows[:, 0], rows[:, 1]]).to(distributed.device())

    @torch.no_grad()
    def compute(self, engine: Any) -> torch.Tensor:
        import torch.distributed as dist

        found: list[tuple[int, float, float]] = []
        with self.view(engine) as reference:
            shards = loop.shard_batches(
                self.examples, self.batch_size, dist.get_rank(), dist.get_world_size(), pair_length
            )
            for pairs, weight in shards:
                batch = collate(pairs, self.pad)
                total, n = response_logprobs(reference, batch).total.cpu(), len(pairs)
                if weight:
                    found += zip(batch["index"].tolist(), total[:n].tolist(), total[n:].tolist(), strict=True)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, found)
        table = torch.zeros(len(self.examples), 2)
        for index, chosen, rejected in (row for part in gathered for row in part):
            table[index] = torch.tensor([chosen, rejected])
        return table


@torch.no_grad()
def evaluate(engine: Any, view: Callable[[Any], Any], pairs: list[Any], pad: int, cfg: DPOConfig) -> dict[str, float]:
    """DPO loss and metrics on held-out pairs (reference computed here, in the same batch: exactly 0 rewards
    before training), and the KL to the reference on the held-out prompts: exact per-token KL of the
    next-token distributions along each held-out chosen response, summed per response (`kl`, nats) and
    per token (`kl_per_token`). Teacher-forced on fixed responses, so deterministic and needing no
    generation; evaluate's kl_to_baseline is the sampled estimate, the same for every route."""
    import torch.distributed as dist

    engine.eval()
    sums: dict[str, float] = {}
    for chunk, weight in loop.shard_batches(
        pairs, cfg.micro_batch_size, dist.get_rank(), dist.get_world_size(), pair_length
    ):
        batch = collate(chunk, pad)
        seq, logits, first = _forward(engine, batch)
        with view(engine) as reference:
            ref_seq, ref_logits, _ = _forward(reference, batch)
        (pc, pr), (rc, rr) = halves(seq, cfg.loss_type), halves(ref_seq, cfg.loss_type)
        out = dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing, cfg.loss_type)
        n = len(chunk)
        kl = token_kl(logits[:n], ref_logits[:n], batch["loss_mask"][:n, first:].to(logits.device))
        metrics = {k: v * n for k, v in reward_metrics(out, pc, pr).items()}
        chosen = first_half(seq)
        metrics.update(
            kl=float(kl.total.sum()),
            kl_tokens=float(kl.tokens.sum()),
            pairs=float(n),
            nll=-float(chosen.total.sum()),
            nll_tokens=float(chosen.tokens.sum()),
        )
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + weight * value
    engine.train()
    keys = sorted(sums)
    totals = dict(zip(keys, distributed.all_reduce_sum([sums[k] for k in keys]), strict=True))
    pairs_seen, tokens = max(totals.pop("pairs"), 1.0), max(totals.pop("kl_tokens"), 1.0)
    nll = totals.pop("nll") / max(totals.pop("nll_tokens"), 1.0)
    result = {k: v / pairs_seen for k, v in totals.items()}
    result.update(kl_per_token=totals["kl"] / tokens, chosen_nll=nll)
    return result


def reference_sha256(module: torch.nn.Module) -> str:
    """sha256 of the reference's weights under their plain-model names (LoRA parameters skipped, PEFT's
    prefixes removed), gathered under ZeRO-3: equal to export.state_sha256 of the starting model, and
    unchanged by training if the reference is untouched."""
    import deepspeed

    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        if "lora_" in name:
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            value = param.detach().to("cpu", copy=True)
        digest.update(name.removeprefix("base_model.model.").replace(".base_layer", "").encode())
        digest.update(value.float().numpy().tobytes())
    return digest.hexdigest()


def unwrap(model: Any) -> torch.nn.Module:
    """The module under a DeepSpeed engine (a plain module as it is)."""
    return getattr(model, "module", model)


def check_inputs(cfg: DPOConfig, model_flag: str, data: Path) -> Any:
    """The starting model is a causal LM (a reward model dir would load with a fresh LM head), and DATA has
    phase-2 pairs; returns the phase-2 DatasetDict."""
    if Path(cfg.model).expanduser().is_dir():
        loading.model_dir_config(model_flag, cfg.model, "ForCausalLM")
    dataset = phases.load(data, "phase2_reward")
    if len(dataset["train"]) == 0:
        raise UserError(f"--data {data}: the phase2_reward train split is empty; DPO trains on its preference pairs")
    for split in dataset:
        if "rejected" not in dataset[split].column_names or None in dataset[split]["rejected"]:
            raise UserError(
                f"--data {data}: phase2_reward {split} has rows without a rejected response; DPO needs pairs"
            )
    if len(dataset.get("eval", [])) == 0:
        log.warning("phase2_reward has no eval pairs; the DPO metrics are computed on train pairs")
    return dataset


def build_reference(cfg: DPOConfig, world: int) -> Any:
    """None with LoRA (the policy with adapters disabled is the reference), else a frozen copy."""
    if cfg.lora.r:
        return None
    model = loading.load_causal_lm(cfg.model, cfg.trust_remote_code, dtype=loading.torch_dtype(cfg.dtype))
    return engines.frozen(model, cfg.zero_stage, cfg.dtype, cfg.offload, 2 * cfg.micro_batch_size, world)


def train_loss(cfg: DPOConfig, table: ReferenceTable, scale: int = 1):
    """The loop's (engine, batch) -> Loss: DPO against the reference table, plus RPO's chosen NLL when
    rpo_alpha > 0, with the implicit-reward metrics of the micro-batch (the loop logs a step's last ones)."""

    def loss(engine: Any, batch: dict[str, torch.Tensor]) -> loop.Loss:
        ref = table.lookup(engine, batch["index"])
        seq = response_logprobs(engine, batch)
        (pc, pr), (rc, rr) = halves(seq, cfg.loss_type), halves(SequenceLogprobs(ref, seq.tokens), cfg.loss_type)
        out = dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.label_smoothing, cfg.loss_type)
        # only the step's last micro-batch's are logged: computing them reads values back (a GPU sync)
        boundary = engine.is_gradient_accumulation_boundary()
        metrics = {k: v for k, v in reward_metrics(out, pc, pr).items() if k != "loss"} if boundary else {}
        value = out.loss + cfg.rpo_alpha * rpo_term(first_half(seq), batch, scale) if cfg.rpo_alpha else out.loss
        return loop.Loss(value, metrics)

    return loss


def rpo_term(chosen: SequenceLogprobs, batch: dict[str, torch.Tensor], scale: int) -> torch.Tensor:
    """RPO's chosen NLL as the micro-batch's share of its optimizer step's token mean (lm.step_loss: the
    step's chosen tokens on every rank are batch["step_units"]; `scale` = accumulation steps x ranks)."""
    if "step_units" not in batch:
        return chosen_nll(chosen)
    return -chosen.total.sum() / batch["step_units"].to(chosen.total).clamp(min=1) * scale


def run(
    config: KubealignConfig,
    data: Path,
    model_name: str | None,
    output: Path,
    resume: bool = False,
    checkpoint_location: Path | None = None,
) -> dict:
    """Train the policy `model_name` (default: dpo.model) with DPO on DATA's phase 2."""
    cfg = config.dpo if model_name is None else config.dpo.model_copy(update={"model": str(model_name)})

    def build(dataset: Any, tokenizer: Any, world: int, tracker: Any) -> stage.Built:
        from transformers import AutoModelForCausalLM

        pad = tokenizer.pad_token_id
        train = tokenize(dataset["train"], tokenizer, cfg.max_seq_len)
        evals = tokenize(dataset["eval"], tokenizer, cfg.max_seq_len) if len(dataset.get("eval", [])) else train[:256]
        with engines.zero3_loading(engines.ds_config(cfg, world, torch.cuda.is_available())):
            dtype = loading.torch_dtype(cfg.dtype)
            model = loading.load_causal_lm(
                cfg.model, cfg.trust_remote_code, dtype=dtype, **loading.revision_kw(cfg.revision)
            )
            model = engines.apply_lora(model, cfg.lora, "CAUSAL_LM")
        # No dropout (TRL's DPOTrainer default): with it the policy's log-probs are noisy against the
        # eval-mode reference and the implicit rewards are not 0 before the first step.
        disable_dropout(model)
        frozen = build_reference(cfg, world)
        view = lambda engine: reference_view(engine, frozen)  # noqa: E731
        table = ReferenceTable(train, pad, 2 * cfg.micro_batch_size, view)
        # The reference's weights before and after training, recorded in result.json: a cheap proof that
        # it was not trained (collective under ZeRO-3, like the export's gather).
        before = reference_sha256(unwrap(frozen) if frozen is not None else model)

        def finished(engine: Any) -> dict[str, Any]:
            after = reference_sha256(unwrap(frozen if frozen is not None else engine))
            if after != before:
                raise RuntimeError("dpo: the reference's weights changed during training")  # a bug, never input
            kind = "adapters-disabled" if frozen is None else "frozen-copy"
            return {"reference": {"kind": kind, "sha256_before": before, "sha256_after": after}}

        return stage.Built(
            model=model,
            train=train,
            evals=evals,
            collate=lambda b: collate(b, pad),
            loss=train_loss(cfg, table, cfg.gradient_accumulation_steps * world),
            evaluate=lambda engine: evaluate(engine, view, evals, pad, cfg),
            model_cls=AutoModelForCausalLM,
            task_type="CAUSAL_LM",
            result={"loss_type": cfg.loss_type, "train_pairs": len(train), "eval_pairs": len(evals)},
            finished=finished,
            length=pair_length,
            units=(lambda pair: lm.loss_tokens(pair["chosen"])) if cfg.rpo_alpha else None,
        )

    load = lambda: check_inputs(cfg, "--model" if model_name is not None else "dpo.model", data)  # noqa: E731
    ref = phase_ref(data, "phase2_reward", "training")  # the run names the data it trains on
    return stage.run(STAGE, config, cfg, load, build, output, resume, checkpoint_location, data=ref)
