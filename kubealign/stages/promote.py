"""Stage 5, promote: register the PPO actor in the MLflow model registry behind a measured gate.

Every promotion registers (once) a version of `promote.registered_model` and points `challenger` at it.
`champion` moves to it only if the gate passes: the configured thresholds (min win-rate over the
baseline, min reward gain, max KL) AND, when a champion exists and `require_beat_champion` is on, a
higher candidate reward than the champion's. The champion it replaces keeps `previous-champion`;
`kubealign rollback` moves `champion` back to it.

Registry operations fail closed:

* Reading the aliases is one `get_registered_model` call, whose alias map is a snapshot of all of them.
  Only a map without `champion` means "no champion". Any failure — a 503, a timeout, a dead server,
  even "model not found" for the model promote has just created — is exit code 2 before any alias
  moves. (`get_model_version_by_alias` cannot tell: MLflow answers a missing alias with the same
  INVALID_PARAMETER_VALUE as a malformed request.)
* MLflow retries a failing request 7 times with exponential backoff and a 120 s timeout by default:
  ~4 minutes per call against a dead registry. Promote and rollback set REGISTRY_HTTP (2 retries,
  backoff factor 1, 30 s timeout) unless the environment sets those variables: a dead or failing
  registry answers in seconds, a transient blip is still retried.
* Alias moves are journaled and ordered. Before the first move the registered-model tag JOURNAL_TAG
  records the aliases as they were and the planned moves. Then `challenger` -> new, `previous-champion`
  -> old champion, `champion` -> new, in that order: at every point the old champion is still
  `champion` or already `previous-champion`, never unreachable. On a failure every journaled alias is
  put back (`champion` first) and read back; the error line says what they were and whether they are so
  again. When even that fails (the server died), the journal stays, and the next promote or rollback
  on the registry first undoes the interrupted move (or, if every move had landed, just clears it).
* Concurrent promotes (and rollbacks) of one registered model are serialized by a lease the registry
  itself holds: the registered model `<name>.promotion-lease`. `create_registered_model` is an
  insert under a unique key in the registry's database, so exactly one of several concurrent creates
  succeeds (RESOURCE_ALREADY_EXISTS for the others) on every MLflow backend with a database (sqlite,
  PostgreSQL, MySQL, directly or through `mlflow server`); a tag written and read back could not do
  that (last writer wins). The lease's tags name its owner (host:pid:nonce) and expiry; the holder
  deletes it when done. A waiter breaks a lease whose expiry has passed, or whose owner was a process
  on this host that no longer exists; otherwise it waits up to LEASE_WAIT_S. Under the lease a
  promotion looks for the version carrying its promotion key (sha256 of the evaluation and the weights),
  registers one only if none exists, reads the champion, gates and moves aliases — so two promotes of
  one evaluation register one version, and two of different evaluations gate one against the other.
  Breaking an expired lease is check-then-delete, so it assumes a holder older than LEASE_TTL_S is
  dead; as a fence, a version registered under a lease that was broken anyway is deleted again when an
  older version carries the same key.
* MLflow's file store (opt-in since MLflow 3) creates a registered model by check-then-mkdir, not
  atomically: there a file lock beside the store (filelock) is taken as well.
* The model is logged from code (kubealign.registry), with explicit pip requirements: no pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.config import KubealignConfig
from kubealign.config.schema import PromoteConfig
from kubealign.errors import UserError, first_line
from kubealign.outputs import atomic_dir, check_output_path, read_result, write_result
from kubealign.tracking import PARENT_RUN_ENV, http_settings, resolve_uri, stage_run

STAGE = "promote"
CHALLENGER, CHAMPION, PREVIOUS = "challenger", "champion", "previous-champion"
ALIASES = (CHALLENGER, CHAMPION, PREVIOUS)
KEY_TAG = "kubealign.promotion_key"
JOURNAL_TAG = "kubealign.alias_journal"
LEASE_SUFFIX = ".promotion-lease"
LEASE_TTL_S = 300  # a lease older than this is taken to be from a dead promote (it holds it for seconds)
LEASE_WAIT_S = 330  # > LEASE_TTL_S: a waiter always outlives a dead holder's lease
LEASE_POLL_S = 0.5
REGISTRY_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
GATED_METRICS = ("win_rate", "reward_gain", "kl_to_baseline", "candidate_reward_mean")
OPTIONAL_METRICS = ("win_rate_lower_bound",)  # gated only when its threshold is set


def gate(metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None) -> tuple[bool, list[str]]:
    """(passed, one line per check) for an evaluation's metrics against the thresholds and the champion.
    promote.metric win_rate: the win-rate checks and the champion's candidate_reward_mean; another metric
    (e.g. fn/<NAME>/candidate) replaces them: min_metric, the baseline's value, the champion's value."""
    checks = [] if cfg.metric != "win_rate" else win_rate_checks(metrics, cfg)
    checks.append(
        (
            metrics["reward_gain"] >= cfg.min_reward_gain,
            f"reward_gain {metrics['reward_gain']:.3f} >= {cfg.min_reward_gain}",
        )
    )
    if cfg.max_kl is not None:
        kl = metrics["kl_to_baseline"]
        checks.append((kl <= cfg.max_kl, f"kl_to_baseline {kl:.3f} <= {cfg.max_kl}"))
    if cfg.metric != "win_rate":
        checks += metric_checks(metrics, cfg, champion)
    elif champion is not None and cfg.require_beat_champion:
        ours, theirs = metrics["candidate_reward_mean"], champion["candidate_reward_mean"]
        checks.append((ours > theirs, f"candidate_reward_mean {ours:.3f} > champion's {theirs:.3f}"))
    return all(ok for ok, _ in checks), [("pass: " if ok else "FAIL: ") + text for ok, text in checks]


def win_rate_checks(metrics: dict[str, float], cfg: PromoteConfig) -> list[tuple[bool, str]]:
    checks = [(metrics["win_rate"] >= cfg.min_win_rate, f"win_rate {metrics['win_rate']:.3f} >= {cfg.min_win_rate}")]
    if cfg.min_win_rate_lower_bound is not None:
        bound = metrics.get("win_rate_lower_bound")
        if bound is None:
            raise UserError("promote.min_win_rate_lower_bound is set but the evaluation has no win_rate_lower_bound")
        threshold = cfg.min_win_rate_lower_bound
        checks.append((bound >= threshold, f"win_rate_lower_bound {bound:.3f} >= {threshold}"))
    return checks


def metric_checks(metrics: dict[str, float], cfg: PromoteConfig, champion: dict[str, float] | None
                  ) -> list[tuple[bool, str]]:  # fmt: skip
    """promote.metric's checks: its threshold, the SFT baseline's value of an fn/<NAME>/candidate metric, and
    the champion's value (a champion registered without this metric is not compared: said so)."""
    name = cfg.metric
    if name not in metrics:
        have = ", ".join(sorted(m for m in metrics if m.startswith("fn/"))) or "no fn/ metrics"
        raise UserError(f"promote.metric {name}: the evaluation has no such metric ({have})")
    ours = metrics[name]
    checks = []
    if cfg.min_metric is not None:
        checks.append((ours >= cfg.min_metric, f"{name} {ours:.3f} >= {cfg.min_metric}"))
    if name.endswith("/candidate") and name.removesuffix("/candidate") + "/baseline" in metrics:
        base = metrics[name.removesuffix("/candidate") + "/baseline"]
        checks.append((ours > base, f"{name} {ours:.3f} > the baseline's {base:.3f}"))
    if champion is not None and cfg.require_beat_champion:
        theirs = champion.get(name, float("nan"))
        if math.isnan(theirs):
            checks.append((True, f"{name}: the champion has none recorded, not compared"))
        else:
            checks.append((ours > theirs, f"{name} {ours:.3f} > champion's {theirs:.3f}"))
    return checks


@contextlib.contextmanager
def registry_errors(uri: str) -> Iterator[None]:
    """Any failure talking to the registry (an MLflow error, a connection error, a local store's OS
    error) as one UserError line."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, requests.RequestException, OSError) as exc:
        raise UserError(f"MLflow registry at {uri}: {first_line(exc)}") from None


def error_code(exc: BaseException) -> str | None:
    return getattr(exc, "error_code", None)


def read_state(client: Any, name: str) -> tuple[dict[str, str], dict[str, str]]:
    """(aliases -> version, tags) of the registered model, from one call. Any failure raises, even
    RESOURCE_DOES_NOT_EXIST (promote has just made sure the model exists): an unreadable champion is
    not an absent one. Only a readable alias map without `champion` means "no champion"."""
    model = client.get_registered_model(name)
    return {a: str(v) for a, v in (model.aliases or {}).items()}, dict(model.tags or {})


def describe(aliases: dict[str, str | None]) -> str:
    return ", ".join(f"{a}={aliases.get(a) or 'none'}" for a in sorted(aliases, key=ALIASES.index))


def set_alias(client: Any, name: str, alias: str, version: str | None) -> None:
    if version is None:
        client.delete_registered_model_alias(name, alias)
    else:
        client.set_registered_model_alias(name, alias, version)


def put_back(client: Any, name: str, before: dict[str, str | None]) -> None:
    """Set the aliases to `before` (champion first: it is what consumers load) and check they read so."""
    for alias in sorted(before, key=lambda a: a != CHAMPION):
        set_alias(client, name, alias, before[alias])
    now, _ = read_state(client, name)
    if any(now.get(a) != v for a, v in before.items()):
        raise RuntimeError(f"they read back as {describe({a: now.get(a) for a in before})}")


def move_aliases(client: Any, uri: str, name: str, aliases: dict[str, str], plan: list[tuple[str, str | None]]) -> None:
    """Apply `plan` ((alias, version or None to delete), in order) under the journal; on a failure put
    the aliases back and raise a UserError that says what they were and whether they are so again."""
    plan = [(a, v) for a, v in plan if aliases.get(a) != v]
    if not plan:
        return
    before = {a: aliases.get(a) for a, _ in plan}
    journal = {"before": before, "plan": plan, "time": time.time()}
    client.set_registered_model_tag(name, JOURNAL_TAG, json.dumps(journal))  # fails before any move
    try:
        for alias, version in plan:
            set_alias(client, name, alias, version)
    except Exception as exc:
        failed = f"MLflow registry at {uri}: moving aliases of {name} failed ({first_line(exc)})"
        try:
            put_back(client, name, before)
        except Exception as again:
            raise UserError(
                f"{failed}, and they could not be put back ({first_line(again)}): they were {describe(before)}; "
                f"the next `kubealign promote` or `kubealign rollback` on this registry restores them from the "
                f"registered-model tag {JOURNAL_TAG}"
            ) from None
        with contextlib.suppress(Exception):  # a journal left behind is undone again (a no-op) next time
            client.delete_registered_model_tag(name, JOURNAL_TAG)
        raise UserError(f"{failed}; aliases put back as they were: {describe(before)}") from None
    with contextlib.suppress(Exception):  # every move landed: a journal left behind is only cleared next time
        client.delete_registered_model_tag(name, JOURNAL_TAG)


def recover(client: Any, uri: str, name: str) -> dict[str, str]:
    """The aliases, after undoing a move that a dead or failed promote/rollback left journaled (the
    caller holds the lease, so no one is in the middle of it)."""
    aliases, tags = read_state(client, name)
    if JOURNAL_TAG not in tags:
        return aliases
    try:
        journal = json.loads(tags[JOURNAL_TAG])
        undo = any(aliases.get(a) != v for a, v in journal["plan"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"registered model {name}: tag {JOURNAL_TAG} is not a kubealign alias journal") from None
    if undo:
        try:
            put_back(client, name, journal["before"])
        except Exception as exc:
            raise UserError(
                f"MLflow registry at {uri}: {name} has aliases half-moved by an interrupted promotion and they "
                f"could not be put back ({first_line(exc)}): they were {describe(journal['before'])}"
            ) from None
        print(
            f"kubealign: warning: {name}: put back aliases left half-moved by an interrupted promotion or "
            f"rollback: {describe(journal['before'])}",
            file=sys.stderr,
        )
    client.delete_registered_model_tag(name, JOURNAL_TAG)
    return read_state(client, name)[0]


def lease_tags(client: Any, lock: str) -> dict[str, str] | None:
    try:
        return dict(client.get_registered_model(lock).tags or {})
    except Exception as exc:
        if error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def holder_is_dead(holder: dict[str, str]) -> bool:
    """The lease has expired, or its owner was a process on this host that is gone."""
    try:
        if float(holder.get("expires", "0")) < time.time():
            return True
    except ValueError:
        return True  # not a lease kubealign wrote
    host, _, rest = holder.get("owner", "").partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # it exists (another user's process)
    return False


def take_lease(client: Any, lock: str, owner: str) -> bool:
    """Create the lease model (an atomic create-if-absent in the registry's database); True if ours."""
    expires = f"{time.time() + LEASE_TTL_S:.0f}"
    try:
        client.create_registered_model(lock, tags={"owner": owner, "expires": expires})
        return True
    except Exception as exc:
        if error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
            # MLflow's SQL store answers a create that lost the unique insert by reading the winner back;
            # when the winner released (deleted) it in between, that read fails. The lease is free: try
            # again. (Seen on PostgreSQL: 5 of 120 takes racing a release; tests/test_production_stores.py.)
            return False
        if error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
    holder = lease_tags(client, lock)
    if holder is None:  # released in between: try again
        return False
    if holder.get("owner") == owner:  # our create landed but its answer was lost; MLflow's retry was refused
        return True
    if holder_is_dead(holder):
        with contextlib.suppress(Exception):  # another waiter may break it first
            client.delete_registered_model(lock)
    return False


def file_store_lock(uri: str) -> contextlib.AbstractContextManager:
    """MLflow's file store (opt-in since MLflow 3) creates a registered model by check-then-mkdir, which
    two processes can both pass: there the lease is also a file lock in the store's directory."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    if parts.scheme not in ("", "file"):
        return contextlib.nullcontext()
    from filelock import FileLock

    root = Path(parts.path if parts.scheme else uri)
    root.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root / ".kubealign-promotion.lock"), timeout=LEASE_WAIT_S)


def release(client: Any, lock: str, owner: str) -> None:
    with contextlib.suppress(Exception):  # unreachable registry: the lease expires after LEASE_TTL_S
        if (lease_tags(client, lock) or {}).get("owner") == owner:
            client.delete_registered_model(lock)


@contextlib.contextmanager
def lease(client: Any, uri: str, name: str) -> Iterator[str]:
    """Hold the registry lease of `name` (see the module docstring) for the duration."""
    from filelock import Timeout

    lock = name + LEASE_SUFFIX
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + LEASE_WAIT_S
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_store_lock(uri))
        except Timeout:
            raise UserError(f"registered model {name}: another promote or rollback holds the file lock") from None
        while not take_lease(client, lock, owner):
            if time.monotonic() > deadline:
                holder = lease_tags(client, lock) or {}
                raise UserError(
                    f"registered model {name}: another promote or rollback has held its lease (registered model "
                    f"{lock}, owner {holder.get('owner')}) for over {LEASE_WAIT_S} s; if none is running, delete "
                    f"{lock}"
                )
            time.sleep(LEASE_POLL_S * (0.5 + random.random()))
        stack.callback(release, client, lock, owner)
        yield owner


def promotion_key(evaluation: Path, model_dir: Path) -> str:
    digest = hashlib.sha256((evaluation / "result.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(hashlib.sha256(weights.read_bytes()).digest())
    return digest.hexdigest()


def find_version(client: Any, name: str, key: str) -> Any:
    """The oldest version carrying this promotion key, or None."""
    found = client.search_model_versions(f"name = '{name}' and tag.`{KEY_TAG}` = '{key}'")
    return min(found, key=lambda v: int(v.version), default=None)


def upload_model(client: Any, run_id: str, model_dir: Path) -> str:
    """Log the actor as a pyfunc model into the run's artifacts; its source URI for a model version.
    Only MlflowClient calls: the fluent API would leave a process-wide tracking/registry URI behind."""
    import tempfile

    import mlflow.pyfunc

    from kubealign.registry import INPUT_EXAMPLE, MODEL_CODE

    with tempfile.TemporaryDirectory() as tmp:
        # From code, not a pickled object; the signature comes from predict's type hints plus the
        # example's params. MLflow runs predict on the example once: a smoke test of what is registered.
        code = Path(tmp) / "actor_model.py"
        code.write_text(MODEL_CODE, encoding="utf-8")
        mlflow.pyfunc.save_model(
            path=Path(tmp) / "model",
            python_model=str(code),
            artifacts={"model_dir": str(model_dir)},
            input_example=INPUT_EXAMPLE,
            pip_requirements=[f"kubealign=={__version__}"],
        )
        client.log_artifacts(run_id, str(Path(tmp) / "model"), "model")
    return f"{client.get_run(run_id).info.artifact_uri}/model"


def register_version(client: Any, name: str, source: str, run_id: str, key: str, tags: dict[str, str]) -> Any:
    """A new version carrying the key; if an older one carries it too (only possible if a lease was
    broken while its holder lived), this one is deleted again and the older one returned."""
    created = client.create_model_version(name, source=source, run_id=run_id, tags={KEY_TAG: key, **tags})
    oldest = find_version(client, name, key)
    if oldest is not None and str(oldest.version) != str(created.version):
        client.delete_model_version(name, created.version)
        return oldest
    return created


def run(
    config: KubealignConfig, evaluation: Path, model_dir: Path, output: Path, comparison: Path | None = None
) -> dict[str, Any]:
    """comparison: the compare stage's output when the run trained several routes; this candidate is then
    registered tagged with its rank, and only the leader goes through the gate to the aliases."""
    cfg = config.promote
    started = time.perf_counter()
    check_output_path(output, STAGE)
    result = read_result(evaluation)
    if result.get("stage") != "evaluate":
        raise UserError(f"--evaluation {evaluation}: result.json is from stage {result.get('stage')!r}, not evaluate")
    metrics = result["metrics"]
    missing = [m for m in GATED_METRICS if m not in metrics]
    if missing:
        raise UserError(f"--evaluation {evaluation}: result.json lacks metrics {missing}")
    gate(metrics, cfg, None)  # an evaluation the gate cannot judge is refused before the registry is touched
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {model_dir}: not a model directory (no config.json)")
    if not config.tracking.enabled:
        raise UserError("tracking.enabled is false: promotion needs the MLflow registry")
    recorded = [*GATED_METRICS, *OPTIONAL_METRICS, *(m for m in metrics if m.startswith("fn/"))]
    tags = {f"kubealign.metric.{m}": str(metrics[m]) for m in recorded if m in metrics}
    tags.update({"kubealign.code_version": __version__, "kubealign.evaluation": str(evaluation.resolve())})
    tags["kubealign.pipeline_run_id"] = os.environ.get(PARENT_RUN_ENV) or os.environ.get("MLFLOW_RUN_ID", "")
    tags["kubealign.data_sha256"] = data_hash(result)
    tags["kubealign.algorithm"] = candidate_algorithm(model_dir)
    standing = ranked(comparison, tags["kubealign.algorithm"]) if comparison is not None else None
    if standing is not None:
        tags.update({"kubealign.rank": str(standing["rank"]), "kubealign.leader": standing["leader"]})
    key = promotion_key(evaluation, model_dir)
    error: BaseException | None = None
    run_name = STAGE if standing is None else f"{STAGE}-{standing['route']}"
    try:
        with http_settings(REGISTRY_HTTP), stage_run(run_name, config, output.resolve().parent) as tracker:
            try:
                with registry_errors(tracker.tracking_uri):
                    leads = standing is None or standing["rank"] == 1
                    summary, details = promote_in_registry(tracker, cfg, metrics, model_dir, key, tags, leads)
                    if standing is not None:
                        summary["rank"] = float(standing["rank"])
                        details["comparison"] = standing
                    summary["wall_time_s"] = time.perf_counter() - started
                    tracker.log_metrics(summary)
                with atomic_dir(output) as tmp:
                    payload = write_result(tmp, STAGE, summary, {}, **details)
            except BaseException as exc:
                error = exc
                raise
    except Exception:
        if error is not None:  # ending the run against a dead server must not hide why the stage failed
            raise error from None
        raise
    return {**payload, "output": str(output)}


def promote_in_registry(
    tracker: Any,
    cfg: PromoteConfig,
    metrics: dict[str, float],
    model_dir: Path,
    key: str,
    tags: dict[str, str],
    leads: bool = True,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Register (once) and gate the candidate, move the aliases; (summary metrics, result.json fields).
    leads False (a route the comparison did not rank first): registered and gated, but no alias moves."""
    from mlflow.tracking import MlflowClient

    client, uri, name = MlflowClient(tracker.tracking_uri), tracker.tracking_uri, cfg.registered_model
    try:
        client.create_registered_model(name)
    except Exception as exc:
        if error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
    # The upload (slow, into this run's own artifacts) happens outside the lease; registering is inside.
    source = None if find_version(client, name, key) else upload_model(client, tracker.run_id, model_dir)
    with lease(client, uri, name):
        aliases = recover(client, uri, name)
        version = find_version(client, name, key)
        if version is None:
            source = source or upload_model(client, tracker.run_id, model_dir)
            version = register_version(client, name, source, tracker.run_id, key, tags)
        elif "kubealign.rank" in tags:  # a rerun of the comparison may have ranked a known version anew
            for tag in ("kubealign.rank", "kubealign.leader"):
                client.set_model_version_tag(name, version.version, tag, tags[tag])
        ours, champion = str(version.version), aliases.get(CHAMPION)
        champion_metrics = None
        if champion is not None and champion != ours:
            theirs = client.get_model_version(name, champion).tags
            wanted = [*GATED_METRICS, *([cfg.metric] if cfg.metric != "win_rate" else [])]
            champion_metrics = {m: float(theirs.get(f"kubealign.metric.{m}", "nan")) for m in wanted}
        passed, checks = gate(metrics, cfg, champion_metrics)
        plan: list[tuple[str, str | None]] = [(CHALLENGER, ours)] if leads else []
        if leads and passed and champion != ours:
            plan += [(PREVIOUS, champion)] if champion is not None else []
            plan.append((CHAMPION, ours))
        move_aliases(client, uri, name, aliases, plan)
        after, _ = read_state(client, name)
    summary = {"gate_passed": float(passed), "version": float(ours)}
    details = {
        "registered_model": name,
        "version": int(ours),
        "aliases": {a: None if after.get(a) is None else int(after[a]) for a in ALIASES},
        "aliases_before": {a: None if aliases.get(a) is None else int(aliases[a]) for a in ALIASES},
        "gate": checks,
        "model_uri": f"models:/{name}/{ours}",
    }
    return summary, details


def ranked(comparison: Path, route: str) -> dict[str, Any]:
    """This route's place in the compare stage's result: rank, leader, and why it is not first; plus
    every other route's, so that each promotion says which route won and why the others did not."""
    result = read_result(comparison)
    if result.get("stage") != "compare":
        raise UserError(f"--comparison {comparison}: result.json is from stage {result.get('stage')!r}, not compare")
    standings = {s["route"]: s for s in result["standings"]}
    if route not in standings:
        ranked_routes = ", ".join(standings) or "none"
        raise UserError(
            f"--comparison {comparison}: the candidate's route {route} is not ranked there ({ranked_routes})"
        )
    ours = standings[route]
    others = {s["route"]: f"rank {s['rank']}: {s['why']}" for s in result["standings"] if s["rank"] != 1}
    others.update({failed: "failed: not ranked" for failed in result.get("failed", [])})
    verdict = "the leader" if ours["rank"] == 1 else f"not the leader (rank {ours['rank']}): {ours['why']}"
    return {
        "route": route,
        "rank": ours["rank"],
        "leader": result["leader"],
        "verdict": verdict,
        "others": others,
    }


def candidate_algorithm(model_dir: Path) -> str:
    """How the candidate was trained (ppo, grpo, rloo, dpo), from the result.json its stage wrote: the
    registry compares versions made by every route with one gate, and this tag says which is which."""
    try:
        produced = json.loads((model_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return "unknown"
    if produced.get("stage") == "ppo":
        return str(produced.get("algorithm") or "ppo")
    return str(produced.get("stage") or "unknown")


def data_hash(evaluation_result: dict[str, Any]) -> str:
    """The data-split cache key of the prompts the evaluation used, when its manifest is at hand."""
    prompts = evaluation_result.get("models", {}).get("prompts")
    try:
        return json.loads((Path(prompts) / "manifest.json").read_text(encoding="utf-8"))["cache_key"]
    except (TypeError, OSError, KeyError, json.JSONDecodeError):
        return ""


def rollback(config: KubealignConfig) -> dict[str, Any]:
    """champion -> previous-champion (which is then cleared), under the lease and the journal; returns
    the new alias state. Fails closed like promote: an unreadable alias is an error, not an absent one."""
    from mlflow.tracking import MlflowClient

    uri = resolve_uri(config)  # refuses credentials in the URI, like every stage
    if not uri:
        raise UserError("rollback: set MLFLOW_TRACKING_URI (or tracking.uri) to the registry to roll back in")
    name = config.promote.registered_model
    with http_settings(REGISTRY_HTTP), registry_errors(uri):
        client = MlflowClient(uri)
        with lease(client, uri, name):
            aliases = recover(client, uri, name)
            previous, current = aliases.get(PREVIOUS), aliases.get(CHAMPION)
            if previous is None:
                raise UserError(f"rollback: {name} has no {PREVIOUS} alias to roll back to")
            move_aliases(client, uri, name, aliases, [(CHAMPION, previous), (PREVIOUS, None)])
    return {"champion": previous, "rolled_back_from": current}
