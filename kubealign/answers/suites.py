"""Benchmark suites: the baseline and the candidate, each scored by lm-eval-harness on the tasks
evaluate.suites names, already loaded by evaluate (no second load, no hub), and lm-eval's results read into
the figures the suite guard compares.

lm-eval is an optional dependency (`pip install 'kubealign[eval]'`), imported only when a suite is named.
kubealign's own task directory (kubealign/data/suites: `kubealign_facts`) is always on lm-eval's search path,
with the user's include_path first. The figures (`suite_figures`: baseline_suite_<task>, candidate_suite_<task>)
go into evaluate's metrics, where promote.guards.max_suite_drop reads them (kubealign.promotion.guards).
"""

from __future__ import annotations

import io
import logging
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any
from unittest import mock

from kubealign.config.suites import SuitesConfig
from kubealign.errors import UserError
from kubealign.promotion.guards import SUITE_PREFIX

log = logging.getLogger(__name__)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "suites"


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UserError(
            "evaluate.suites: lm-eval-harness is not installed: pip install 'kubealign[eval]' "
            "(or set evaluate.suites.tasks: [])"
        ) from None
    return lm_eval


def search_path(cfg: SuitesConfig, base_dir: str | None) -> list[str]:
    """Task directories lm-eval reads, the user's first; a missing user directory is refused by name."""
    paths = [str(SHIPPED_DIR)]
    if cfg.include_path is not None:
        path = Path(cfg.include_path)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if not path.is_dir():
            raise UserError(f"evaluate.suites.include_path: {path} is not a directory")
        paths.insert(0, str(path))
    return paths


@contextmanager
def _quiet():
    """lm-eval's progress bars (tqdm, on sys.stderr), INFO logging and its `git describe` (a version stamp of
    its own checkout, meaningless for an installed wheel, which prints git's 'fatal: not a git repository')
    kept out of the task's output: kubealign's debug log gets the bars' last line."""
    from lm_eval import evaluator

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    printed = io.StringIO()
    try:
        with redirect_stderr(printed), mock.patch.object(evaluator, "get_git_commit_hash", lambda: None):
            yield
    finally:
        logger.setLevel(level)
        tail = printed.getvalue().strip().rsplit("\r", 1)[-1].splitlines()[-1:]
        log.debug("lm-eval: %s", tail[0] if tail else "(nothing printed)")


def score(model: Any, tokenizer: Any, cfg: SuitesConfig, manager: Any) -> dict[str, dict[str, Any]]:
    """lm-eval's per-task results of one model: {task: {"acc,none": ..., ...}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, device=str(model.device))
    out = simple_evaluate(
        model=lm,
        tasks=list(cfg.tasks),
        task_manager=manager,
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        log_samples=False,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    return out["results"]


def suite_figures(
    baseline: dict[str, dict[str, Any]], candidate: dict[str, dict[str, Any]], tasks: list[str], metric: str
) -> dict[str, float]:
    """Both models' `metric` on each named task, from lm-eval's per-task results ({task: {"acc,none": x, ...}};
    the first filter's value: "none" unless the task filters its answers). A task without the metric is refused
    by name: the guard would otherwise check nothing while saying it passed."""
    out: dict[str, float] = {}
    for task in tasks:
        for who, results in (("baseline", baseline), ("candidate", candidate)):
            found = results.get(task, {})
            keys = [k for k in found if k.split(",", 1)[0] == metric]
            value = found.get(f"{metric},none", found.get(keys[0]) if keys else None)
            if not isinstance(value, int | float):
                have = sorted({k.split(",", 1)[0] for k in found if "," in k and "stderr" not in k})
                said = ", ".join(have) or "nothing"
                raise UserError(f"evaluate.suites.metric: task {task} reports no {metric!r} (it reports: {said})")
            out[f"{who}_{SUITE_PREFIX}{task}"] = float(value)
    return out


def run(cfg: SuitesConfig, base_dir: str | None, models: dict[str, Any], tokenizer: Any) -> dict[str, float]:
    """Both models on every task: suite figures for evaluate's metrics. models: {"baseline": m, "candidate": m}."""
    if not cfg.tasks:
        return {}
    _lm_eval()
    from lm_eval.tasks import TaskManager

    with _quiet():
        paths = search_path(cfg, base_dir)
        # lm-eval's own catalogue is ~15k YAML files (20 s to index on 2 cores): read only when a task is not in
        # kubealign's directory or the user's
        manager = TaskManager(include_path=paths, include_defaults=False)
        if any(name not in manager.all_tasks for name in cfg.tasks):
            manager = TaskManager(include_path=paths)
        unknown = [name for name in cfg.tasks if name not in manager.all_tasks]
        if unknown:
            raise UserError(
                f"evaluate.suites.tasks: no lm-eval task named {', '.join(unknown)} (kubealign's: "
                f"kubealign_facts; your own: a YAML in evaluate.suites.include_path)"
            )
        results = {who: score(model, tokenizer, cfg, manager) for who, model in models.items()}
    return suite_figures(results["baseline"], results["candidate"], cfg.tasks, cfg.metric)
