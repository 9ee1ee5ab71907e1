"""Benchmark suites: the baseline and the candidate, each scored by lm-eval-harness on the tasks
evaluate.suites names, already loaded by evaluate (no second load, no hub), and lm-eval's results read into
the figures the suite guard compares.

lm-eval is an optional dependency (`pip install 'kubealign[eval]'`), imported only when a suite is named.
kubealign's own task directory (kubealign/data/suites: `kubealign_facts`) is always on lm-eval's search path,
with the user's include_path first. The figures (`suite_figures`: baseline_suite_<task>, candidate_suite_<task>)
go into evaluate's metrics, where promote.guards.max_suite_drop reads them (kubealign.promotion.guards).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any
from unittest import mock

from kubealign.config.suites import SuitesConfig
from kubealign.errors import UserError, first_line
from kubealign.promotion.guards import SUITE_PREFIX

log = logging.getLogger(__name__)
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "suites"
CODE_TAG = "!function"  # lm-eval's YAML tag that imports a module and names a function of it


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UserError(
            "evaluate.suites: lm-eval-harness is not installed: pip install 'kubealign[eval]' "
            "(or set evaluate.suites.tasks: [])"
        ) from None
    return lm_eval


def _yaml_include(path: Path) -> list[str]:
    """The files a task YAML's `include:` names (lm-eval reads them too), read with any tag taken as nothing."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        doc = yaml.load(path.read_text(encoding="utf-8", errors="replace"), Loader=Loader)  # noqa: S506
    except yaml.YAMLError:
        return []  # lm-eval refuses it too
    named = doc.get("include") if isinstance(doc, dict) else None
    return [str(n) for n in (named if isinstance(named, list) else [named]) if isinstance(n, str)]


def task_files(root: Path) -> dict[str, Path]:
    """Every file lm-eval may read for include_path `root`, by a name that is the same wherever it is read: each
    file under it (links followed; its path relative to root) and each YAML one of them includes from elsewhere
    (the name as given, relative to root unless absolute), and theirs."""
    found: dict[str, Path] = {}
    seen: set[str] = set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up: walked once
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for name in sorted(names):
            file = Path(folder) / name
            if file.is_file():
                found[file.relative_to(root).as_posix()] = file
    pending = [key for key in found if key.endswith((".yaml", ".yml"))]
    while pending:
        key = pending.pop()
        for named in _yaml_include(found[key]):
            other = named if os.path.isabs(named) else os.path.normpath(os.path.join(os.path.dirname(key), named))
            file = Path(other) if os.path.isabs(other) else root / other
            if other not in found and file.is_file() and not file.resolve().is_relative_to(SHIPPED_DIR):
                found[other] = file
                pending.append(other)
    return found


def check_code(cfg: SuitesConfig, root: Path) -> None:
    """Refuse an include_path that brings Python (a .py file, a YAML with `!function`), unless allow_code."""
    if cfg.allow_code:
        return
    for file in task_files(root).values():
        if file.suffix in (".py", ".pyc"):
            why = f"a {file.suffix} file"
        elif file.suffix in (".yaml", ".yml") and CODE_TAG in file.read_text(encoding="utf-8", errors="replace"):
            why = f"a {CODE_TAG} tag"
        else:
            continue
        raise UserError(
            f"evaluate.suites.include_path: {file} holds Python ({why}): it would run inside the evaluate process, "
            "with its credentials; set evaluate.suites.allow_code: true to run it"
        )


def include_dir(cfg: SuitesConfig, base_dir: str | None) -> Path | None:
    """The user's task directory (relative to the config file's), refused by name when it is not one."""
    if cfg.include_path is None:
        return None
    path = Path(cfg.include_path)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_dir():
        raise UserError(f"evaluate.suites.include_path: {path} is not a directory")
    return path


def search_path(cfg: SuitesConfig, base_dir: str | None) -> list[str]:
    """Task directories lm-eval reads, the user's first; a missing user directory, or one holding Python without
    allow_code, is refused by name."""
    path = include_dir(cfg, base_dir)
    if path is None:
        return [str(SHIPPED_DIR)]
    check_code(cfg, path)
    return [str(path), str(SHIPPED_DIR)]


def fingerprint(cfg: SuitesConfig, base_dir: str | None) -> str:
    """The sha256 of what the user's suites are (allow_code, every file include_code_files names, by content): what
    the compiled pipeline pins on evaluate (its cache key) and the task checks. "" when no suite reads anything of
    the user's (no task named, or no include_path)."""
    path = include_dir(cfg, base_dir) if cfg.tasks else None
    if path is None:
        return ""
    check_code(cfg, path)
    files = {key: hashlib.sha256(file.read_bytes()).hexdigest() for key, file in task_files(path).items()}
    pinned = json.dumps({"allow_code": cfg.allow_code, "files": files}, sort_keys=True)
    return hashlib.sha256(pinned.encode()).hexdigest()


def check_pinned(cfg: SuitesConfig, base_dir: str | None, pinned: str) -> None:
    """Refuse suites other than those the pipeline was compiled with (an edited file, allow_code turned on)."""
    now = fingerprint(cfg, base_dir)
    if now != pinned:
        raise UserError(
            f"evaluate.suites: the include_path files or allow_code are not those compiled into the pipeline (sha256 "
            f"{now[:12] or 'none'} here, {pinned[:12] or 'none'} compiled): compile the pipeline with the suites it "
            "should run"
        )


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


@contextmanager
def templates(cfg: SuitesConfig):
    """lm-eval renders every task's templates (doc_to_text, ...) with one unsandboxed Jinja environment, where
    `{{ cycler.__init__.__globals__.os }}` is Python: without allow_code they render in Jinja's sandbox, the same
    filters kept."""
    if cfg.allow_code:
        yield
        return
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    sandboxed = SandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    sandboxed.filters.update(utils.env.filters)
    with mock.patch.object(utils, "env", sandboxed):
        yield


def rendered(call: Any) -> Any:
    """call(), a template's reach for Python (Jinja's SecurityError) as one line."""
    from jinja2.exceptions import SecurityError

    try:
        return call()
    except SecurityError as exc:
        raise UserError(
            f"evaluate.suites: a task's template reached for Python ({first_line(exc)}); templates render "
            "sandboxed: set evaluate.suites.allow_code: true to run it"
        ) from None


def score(model: Any, tokenizer: Any, cfg: SuitesConfig, manager: Any) -> dict[str, dict[str, Any]]:
    """lm-eval's per-task results of one model: {task: {"acc,none": ..., ...}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.batch_size, device=str(model.device))
    evaluate = functools.partial(
        simple_evaluate,
        model=lm,
        tasks=list(cfg.tasks),
        task_manager=manager,
        num_fewshot=cfg.num_fewshot,
        limit=cfg.limit,
        log_samples=False,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    return rendered(evaluate)["results"]


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

    with _quiet(), templates(cfg):
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
