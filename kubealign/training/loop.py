"""The training loop shared by the SFT and reward stages: epochs of micro-batches on a DeepSpeed
engine, periodic evaluation, checkpoints with an exact resume, metrics to MLflow, a progress bar.

Resume is exact: a checkpoint holds the engine (weights, optimizer, scheduler), the step, the epoch,
the micro-batch position inside the epoch and every RNG state, and the batches are a function of
(seed, epoch, lengths) through kubealign.data.batching, so a resumed run sees the same batches in the same
order with the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from kubealign import ranks
from kubealign.config.schema import TrainConfig
from kubealign.data import batching
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.training import checkpoints, distributed, preemption
from kubealign.training import engine as engines

log = logging.getLogger(__name__)
FAULT_ENV = "KUBEALIGN_FAULT_AT_STEP"  # testing hook: signal this process right after that optimizer step
FAULT_SIGNAL_ENV = "KUBEALIGN_FAULT_SIGNAL"  # ... with this signal (KILL by default; TERM: a preemption)


def fault_hook(step: int) -> None:
    """The testing hook: at step FAULT_ENV, send this process FAULT_SIGNAL_ENV (SIGKILL: nothing runs after;
    SIGTERM: the stage's handler takes it, as it takes the kubelet's). Rank 0 only for TERM (the others
    must learn of it through StopRequest.agreed, as they would of a signal only one pod got)."""
    if os.environ.get(FAULT_ENV) != str(step):
        return
    name = os.environ.get(FAULT_SIGNAL_ENV, "KILL")
    if name == "KILL" or ranks.is_main():
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))


class Loss(NamedTuple):
    """A loss with metrics of its micro-batch: those of each step's last micro-batch go to MLflow as
    train_<name> and into the step's history entry (a Task's loss may return a bare tensor instead)."""

    value: torch.Tensor
    metrics: dict[str, float]


class Evaluation(NamedTuple):
    """An evaluation's metrics and the files it produced (name -> JSON payload): the last evaluation's are
    written beside the exported model (a Task's evaluate may return the metrics alone)."""

    metrics: dict[str, float]
    files: dict[str, Any]


@dataclass
class Task:
    """What differs between stages: data, how a batch becomes a loss, how to evaluate."""

    name: str
    cfg: TrainConfig
    train: list[Any]
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor | Loss]  # (engine, batch) -> scalar loss
    evaluate: Callable[[Any], dict[str, float] | Evaluation]  # engine -> metrics, reduced over ranks
    checkpoint_dir: Path
    resume: bool = False
    history: list[dict[str, float]] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)  # the last evaluation's (Evaluation.files)
    length: Callable[[Any], int] | None = None  # an example's padded length: what cfg.batching groups by
    units: Callable[[Any], int] | None = None  # an example's share of a token-mean loss (batches get step_units)
    padding_share: float = 0.0  # of the token slots trained on (set by the loop)


def evaluated(task: Task, engine: Any) -> dict[str, float]:
    """task.evaluate's metrics; the files of an Evaluation are kept on the task."""
    out = task.evaluate(engine)
    if isinstance(out, Evaluation):
        task.files = out.files
        return out.metrics
    return out


def peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def shard_batches(
    examples: list[Any], batch_size: int, rank: int, world: int, length: Callable[[Any], int] | None = None
) -> list[tuple[list[Any], float]]:
    """This rank's share of evaluation batches, as (batch, weight). With `length`, the examples are batched
    longest first, so each batch pads little (an evaluation's sums do not depend on the order). Every rank
    gets the same number of batches, because ZeRO-3 gathers parameters collectively in each forward:
    missing batches are filled with a copy of the last one at weight 0."""
    if length is not None:
        order = batching.sorted_batches([length(e) for e in examples], batch_size)
        batches = [[examples[i] for i in batch] for batch in order] or [[]]
    else:
        batches = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)] or [[]]
    weighted = [(b, 1.0) for b in batches]
    while len(weighted) % world:
        weighted.append((batches[-1], 0.0))
    return [(b, w) for b, w in weighted[rank::world] if b]


def example_lengths(task: Task) -> list[int]:
    """Each training example's padded length as the task measures it (all equal when it does not)."""
    return [task.length(e) for e in task.train] if task.length is not None else [1] * len(task.train)


def plan(task: Task, lengths: list[int], world: int, epoch: int) -> batching.Plan:
    cfg = task.cfg
    return batching.epoch_plan(
        lengths, cfg.micro_batch_size, world, cfg.gradient_accumulation_steps, cfg.seed, epoch, cfg.batching
    )


def micro_batches(
    task: Task, lengths: list[int], rank: int, world: int, epoch: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The epoch's collated micro-batches of this rank, in training order (kubealign.data.batching). With
    task.units, each carries `step_units`: the sum of units over its optimizer step's examples on all ranks,
    what a token-mean loss divides by so that the step's loss does not depend on how it was grouped."""
    batches = plan(task, lengths, world, epoch)
    totals = None
    if task.units is not None:
        totals = batching.step_units(batches, [task.units(e) for e in task.train], task.cfg.gradient_accumulation_steps)
    for i, per_rank in enumerate(batches):
        batch = task.collate([task.train[j] for j in per_rank[rank]])
        if totals is not None:
            batch["step_units"] = torch.tensor(float(totals[i // task.cfg.gradient_accumulation_steps]))
        yield batch


def _restore(engine: Any, task: Task) -> dict[str, Any]:
    """Load the checkpoint to resume from (checkpoints.resume_tag); returns the position to continue from."""
    if not task.resume:  # the stage checked the directory is fresh (checkpoints.checkpoint_dir)
        return {"step": 0, "epoch": 0, "micro": 0}
    tag = checkpoints.resume_tag(task.checkpoint_dir)
    if tag is None:
        log.warning("--resume: no checkpoint in %s; starting from the beginning", task.checkpoint_dir)
        return {"step": 0, "epoch": 0, "micro": 0}
    state = checkpoints.load(engine, task.checkpoint_dir, tag)
    distributed.set_rng_state(state["rng"])
    log.info("resumed from %s at step %d", task.checkpoint_dir / tag, state["step"])
    return state


def _save(engine: Any, task: Task, position: dict[str, Any]) -> None:
    state = {**position, "rng": distributed.rng_state()}
    tag = f"step{position['step']}"
    with checkpoints.saving(task.checkpoint_dir, tag, task.name):
        # save_latest=False: `latest` moves only once the tag is sealed (checkpoints.commit), by rename
        engine.save_checkpoint(str(task.checkpoint_dir), tag=tag, client_state=state, save_latest=False)
        checkpoints.seal(task.checkpoint_dir, tag)
    checkpoints.commit(task.checkpoint_dir, tag)
    # Saving draws random numbers inside DeepSpeed; put the RNG back where the checkpoint recorded it, so
    # the run goes on exactly as a run resumed from this checkpoint will.
    distributed.set_rng_state(state["rng"])


class NonFiniteLoss(UserError):
    """A loss that is nan or inf on some rank (see check_finite)."""


def check_finite(losses: dict[str, torch.Tensor]) -> None:
    """Raise NonFiniteLoss on every rank when any of `losses` (scalars, already computed) is nan or inf on
    any rank. One isfinite per loss and one host sync; under several ranks one all_reduce of the flags,
    so that every rank stops at the same step: a rank that stopped alone would leave the others waiting
    in their next collective forever."""
    values = list(losses.values())
    flags = torch.stack([~torch.isfinite(v.detach().float()).all() for v in values]).double().tolist()
    for (name, value), anywhere in zip(losses.items(), distributed.all_reduce_sum(flags), strict=True):
        if anywhere:
            here = float(value.detach().float().sum())
            raise NonFiniteLoss(f"{name} is {here:g}" if not math.isfinite(here) else f"{name} is nan or inf on a rank")


def checkpoint_note(latest: Path) -> str:
    """What a run that stops early leaves: `latest` is DeepSpeed's pointer to the newest checkpoint tag."""
    if latest.is_file():
        return f"the last checkpoint ({latest.parent}, {latest.read_text(encoding='utf-8').strip()}) is kept"
    return "there is no checkpoint"


def stop_if_nonfinite(task: Task, step: int, loss: torch.Tensor, lr: float) -> None:
    """Before optimizer step `step` is applied: stop the stage (exit 2, every rank) when its loss is not
    finite. The output is never written (it is exported only at the end), and the checkpoint dir stays as
    the last save left it, because the bad step is never saved."""
    try:
        check_finite({"loss": loss})
    except NonFiniteLoss as exc:
        raise UserError(
            f"{task.name}: {exc} at step {step} (learning rate {lr:g}; too high?); stopped before the step was "
            f"applied, no model was written, {checkpoint_note(task.checkpoint_dir / 'latest')}"
        ) from None


def nonfinite(metrics: dict[str, float]) -> str:
    """'name value, ...' of the metrics that are nan or inf ('' when all are finite)."""
    return ", ".join(f"{k} {v:g}" for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))


def stop_if_diverged(task: Task, step: int, after: dict[str, float], lr: float) -> None:
    """The last update can leave a model whose every output is nan with no loss computed after it: the
    final evaluation (reduced over ranks, so the same on every rank) must be finite before any export."""
    bad = nonfinite(after)
    if bad:
        raise UserError(
            f"{task.name}: the evaluation after the last step ({step}) gives {bad}: the model diverged (learning "
            f"rate {lr:g}; too high?); no model was written, {checkpoint_note(task.checkpoint_dir / 'latest')}"
        )


def _train(
    task: Task,
    engine: Any,
    ranks: tuple[int, int],
    tracker: Any,
    bar: Any,
    stop: preemption.StopRequest,
    position: dict[str, Any],
    before: dict[str, float],
    total_steps: int,
) -> tuple[int, int]:
    """The optimizer steps from `position` to total_steps; returns (steps done, tokens trained on). At each
    step boundary a stop the ranks agree on (a SIGTERM or SIGINT: preemption) saves a checkpoint, unless
    the step just saved one, and raises Stopped."""
    cfg = task.cfg
    rank, world = ranks
    lengths = example_lengths(task)
    step, epoch, tokens, slots = position["step"], position["epoch"], 0, 0
    step_loss = None
    while step < total_steps:
        for micro, batch in enumerate(micro_batches(task, lengths, rank, world, epoch)):
            if epoch == position["epoch"] and micro < position["micro"]:
                continue  # already trained on before the checkpoint
            boundary = engine.is_gradient_accumulation_boundary()
            out = task.loss(engine, batch)
            loss, metrics = (out.value, out.metrics) if isinstance(out, Loss) else (out, {})
            # nan/inf in any micro-batch stays in the sum; checked once per optimizer step, before it
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            if boundary:
                stop_if_nonfinite(task, step + 1, step_loss, engine.get_lr()[0])
            engine.backward(loss)
            engine.step()
            tokens += int(batch["attention_mask"].sum())
            slots += batch["attention_mask"].numel()
            if not boundary:
                continue
            # DeepSpeed scales each micro-batch's loss by 1 / accumulation: the step's loss is their mean
            step_mean, step_loss = step_loss / cfg.gradient_accumulation_steps, None
            step += 1
            bar.update()
            record = {"train_loss": step_mean.item(), "lr": engine.get_lr()[0]}
            tracker.log_metrics({**record, **{f"train_{k}": v for k, v in metrics.items()}}, step=step)
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < total_steps:
                tracker.log_metrics({f"eval_{k}": v for k, v in evaluated(task, engine).items()}, step=step)
            task.history.append({"step": step, **record, **metrics})
            saved = bool(cfg.save_every_steps) and step % cfg.save_every_steps == 0
            if saved:
                _save(engine, task, {"step": step, "epoch": epoch, "micro": micro + 1, "before": before})
                tracker.flush()  # MLflow holds what the checkpoint does (bounded; no wait while it is down)
            fault_hook(step)
            signum = stop.agreed()
            if signum:
                if not saved:
                    _save(engine, task, {"step": step, "epoch": epoch, "micro": micro + 1, "before": before})
                tracker.flush()
                raise preemption.stopped(task.name, signum, f"step {step}", str(task.checkpoint_dir / f"step{step}"))
            if step >= total_steps:
                break
        else:
            epoch += 1
            continue
        break
    task.padding_share = 1.0 - tokens / slots if slots else 0.0
    return step, tokens


def run(task: Task, model: torch.nn.Module, tracker: Any) -> tuple[Any, dict[str, float]]:
    """Train `model` as `task` says; returns (engine, summary metrics)."""
    rank, world = distributed.init()
    cfg = task.cfg
    per_step = cfg.micro_batch_size * world * cfg.gradient_accumulation_steps
    if len(task.train) < per_step:
        raise UserError(
            f"{task.name}.micro_batch_size: {cfg.micro_batch_size} x {world} rank(s) x "
            f"{cfg.gradient_accumulation_steps} accumulation step(s) is more than the {len(task.train)} training rows"
        )
    config = getattr(model, "config", None)  # a sequence past the position table: an IndexError mid-training
    if hasattr(config, "to_dict"):
        loading.check_fits(f"{task.name}.max_seq_len", cfg.max_seq_len, "model", f"{task.name}.model", config.to_dict())
    steps_per_epoch = len(task.train) // per_step  # batching.epoch_plan: whole steps only
    total_steps = max(math.ceil(cfg.num_train_epochs * steps_per_epoch), 1)
    config = engines.ds_config(cfg, world, torch.cuda.is_available())
    engine = engines.create(model, cfg, config, total_steps)
    position = _restore(engine, task)
    before = evaluated(task, engine) if position["step"] == 0 else position["before"]
    tracker.log_metrics({f"eval_{k}": v for k, v in before.items()}, step=0)
    engine.train()  # from_pretrained returns eval mode; without this a resumed run would train without dropout
    started = time.perf_counter()
    bar = tqdm(
        total=total_steps, initial=position["step"], desc=task.name, unit="step", **({"disable": True} if rank else {})
    )
    with preemption.StopRequest() as stop:
        try:
            step, tokens = _train(task, engine, (rank, world), tracker, bar, stop, position, before, total_steps)
        finally:
            bar.close()  # the stop's line comes after the bar's
    elapsed = time.perf_counter() - started
    after = evaluated(task, engine)
    stop_if_diverged(task, step, after, engine.get_lr()[0])
    tracker.log_metrics({f"eval_{k}": v for k, v in after.items()}, step=step)
    total_tokens, total_time = distributed.all_reduce_sum([tokens, elapsed])
    summary = {
        **{f"before_{k}": v for k, v in before.items()},
        **{f"after_{k}": v for k, v in after.items()},
        "steps": step,
        "train_tokens": total_tokens,
        "tokens_per_s": total_tokens / max(total_time / world, 1e-9),
        "padding_share": task.padding_share,
        "train_time_s": elapsed,
        "peak_memory_mb": peak_memory_mb(),
        "world_size": world,
    }
    return engine, summary


def remove_checkpoints(task: Task) -> None:
    checkpoints.remove(task.checkpoint_dir)  # only what kubealign wrote there


def finish(
    task: Task,
    engine: Any,
    model_cls: Any,
    task_type: str,
    tokenizer: Any,
    output: Path,
    result: dict[str, Any],
    tracker: Any,
    extra_json: dict[str, Any] | None = None,
) -> None:
    """The end every training stage shares: export the model (+ result.json and extra files) atomically,
    log the final metrics, the model dir and the files to MLflow (rank 0), then drop the checkpoints
    unless the config keeps them."""
    from kubealign.training import export

    export.export(engine, model_cls, task.cfg.lora, task_type, tokenizer, output, result, extra_json)
    if ranks.is_main():
        tracker.log_metrics(result["metrics"])
        tracker.set_tags({"kubealign.model_dir": str(output.resolve())})
        for name in ["result.json", *(extra_json or {})]:
            tracker.log_artifact(output / name, task.name)
    if not task.cfg.keep_checkpoints:
        remove_checkpoints(task)
