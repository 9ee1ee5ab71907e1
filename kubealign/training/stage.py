"""The skeleton every loop stage (sft, reward, dpo) shares; the stage supplies only what differs.

In order: the output and checkpoint directories are checked before anything is read, the data phase is
loaded, the ranks and seeds set up, the MLflow run opened, the tokenizer loaded (EOS as pad when it has
none), then the stage builds its model and loop parts (`Built`), training.loop runs them, and the stage's
model is exported with result.json and any files its last evaluation produced (loop.finish).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kubealign.config import KubealignConfig
from kubealign.config.schema import TrainConfig
from kubealign.models import loading
from kubealign.outputs import check_output_path
from kubealign.provenance.manifest import environment
from kubealign.tracking.runs import stage_run
from kubealign.training import checkpoints, distributed, loop


@dataclass
class Built:
    """What a stage builds once its tokenizer is loaded: the model, the loop's parts and its result entries."""

    model: torch.nn.Module
    train: list[Any]
    evals: list[Any]
    collate: Callable[[list[Any]], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], Any]  # (engine, batch) -> loss tensor or loop.Loss
    evaluate: Callable[[Any], Any]  # engine -> metrics or loop.Evaluation (metrics + files for the output)
    model_cls: Any  # the transformers Auto class the export is saved as
    task_type: str  # "CAUSAL_LM" or "SEQ_CLS" (LoRA merge)
    result: dict[str, Any] = field(default_factory=dict)  # stage-specific result.json entries
    # engine -> result entries known only after training (checked then), e.g. dpo's reference hashes
    finished: Callable[[Any], dict[str, Any]] | None = None
    length: Callable[[Any], int] | None = None  # an example's padded length (loop.Task.length)
    units: Callable[[Any], int] | None = None  # an example's share of a token-mean loss (loop.Task.units)
    metrics: dict[str, float] = field(default_factory=dict)  # measured before training, logged with the rest


def run(
    name: str,
    config: KubealignConfig,
    cfg: TrainConfig,
    load: Callable[[], Any],
    build: Callable[[Any, Any, int, Any], Built],
    output: Path,
    resume: bool,
    checkpoint_location: Path | None,
    outputs: dict[str, str] | None = None,
    data: Any = None,
) -> dict[str, Any]:
    """Run the loop stage NAME: load() gives its data (after the output checks), build(dataset, tokenizer,
    world, tracker) its Built; returns the result.json payload with the output dir and the MLflow run. data:
    the tracking.lineage.DatasetRef of what it trains on (logged as the run's dataset input), None: none."""
    check_output_path(output, name)
    checkpoint_dir = checkpoints.checkpoint_dir(output, resume, checkpoint_location)
    dataset = load()
    _, world = distributed.init()
    distributed.seed_everything(cfg.seed)
    started = time.perf_counter()
    with stage_run(name, config, output.resolve().parent, required=False) as tracker:
        tracker.log_inputs([data] if data is not None else [])
        tokenizer = loading.load_tokenizer(cfg.model, cfg.trust_remote_code, cfg.revision)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        built = build(dataset, tokenizer, world, tracker)
        task = loop.Task(
            name=name,
            cfg=cfg,
            train=built.train,
            collate=built.collate,
            loss=built.loss,
            evaluate=built.evaluate,
            checkpoint_dir=checkpoint_dir,
            resume=resume,
            length=built.length,
            units=built.units,
        )
        engine, summary = loop.run(task, built.model, tracker)
        after = built.finished(engine) if built.finished is not None else {}
        summary.update(built.metrics)
        summary["wall_time_s"] = time.perf_counter() - started
        result = {
            "stage": name,
            "metrics": summary,
            "outputs": {"model": ".", **(outputs or {})},
            "base_model": cfg.model,
            **after,
            **built.result,
            "environment": environment(),  # the device and libraries it trained with: the version's manifest
            "history": task.history,
            "tracked_metrics": list(tracker.history),  # every metric, whether MLflow got it or not
        }
        loop.finish(task, engine, built.model_cls, built.task_type, tokenizer, output, result, tracker, task.files)
    return {**result, "output": str(output), "run_id": tracker.run_id}
