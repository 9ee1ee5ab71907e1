"""The registry's aliases (`challenger`, `champion`, `previous-champion`) and how they move, failing closed.

* Reading the aliases is one `get_registered_model` call, whose alias map is a snapshot of all of them.
  Only a map without `champion` means "no champion"; any failure is one UserError before any alias moves
  (`get_model_version_by_alias` cannot tell a missing alias from a malformed request).
* MLflow retries a failing request 7 times with exponential backoff and a 120 s timeout by default:
  ~4 minutes per call against a dead registry. Promote and rollback set REGISTRY_HTTP (2 retries,
  backoff factor 1, 30 s timeout) unless the environment sets those variables.
* Alias moves are journaled and ordered. Before the first move the registered-model tag JOURNAL_TAG
  records the aliases as they were and the planned moves; on a failure every journaled alias is put back
  (`champion` first) and read back. When even that fails the journal stays, and the next promote or
  rollback first undoes the interrupted move (`recover`), or just clears it if every move had landed.
Callers hold the registry lease (kubealign.promotion.lease) around every read-decide-move.

The rules that decide the moves live here too, one function each: a promotion's (`promotion_plan`, the promote
stage) and an online verdict's (`verdict_plan`, the act task and `kubealign judge --act`).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from kubealign.errors import UserError, auth_hint, first_line

CHALLENGER, CHAMPION, PREVIOUS = "challenger", "champion", "previous-champion"
ALIASES = (CHALLENGER, CHAMPION, PREVIOUS)
JOURNAL_TAG = "kubealign.alias_journal"
REGISTRY_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


@contextlib.contextmanager
def registry_errors(uri: str) -> Iterator[None]:
    """Any failure talking to the registry (an MLflow error, a connection error, a local store's OS
    error) as one UserError line."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, requests.RequestException, OSError) as exc:
        raise UserError(f"MLflow registry at {uri}: {first_line(exc)}{auth_hint(exc)}") from None


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


def promotion_plan(
    mode: str, leads: bool, passed: bool, ours: str, champion: str | None
) -> list[tuple[str, str | None]]:
    """The alias moves of a promotion, in journal order. direct: every leader becomes challenger, and champion
    too when it passes (the old champion kept as previous-champion). canary: a leader that passes becomes
    challenger alone, to be judged online beside the champion; with no champion yet it becomes champion."""
    if not leads:
        return []
    if mode == "canary":
        if champion is None:
            return [(CHAMPION, ours)] if passed else []
        return [(CHALLENGER, ours)] if passed and champion != ours else []
    plan: list[tuple[str, str | None]] = [(CHALLENGER, ours)]
    if passed and champion != ours:
        plan += [(PREVIOUS, champion)] if champion is not None else []
        plan.append((CHAMPION, ours))
    return plan


def verdict_plan(promoted: bool, version: str, aliases: dict[str, str]) -> list[tuple[str, str | None]] | None:
    """The alias moves of the online judge's verdict on `version` (kubealign.serving.carry_out), in journal order;
    [] when the registry already says it (a rerun); None when `version` is no longer what the verdict was about."""
    champion, challenger = aliases.get(CHAMPION), aliases.get(CHALLENGER)
    if challenger is None and (champion == version) == promoted:
        return []
    if challenger != version:
        return None
    if not promoted:
        return [(CHALLENGER, None)]
    return [*([(PREVIOUS, champion)] if champion is not None else []), (CHAMPION, version), (CHALLENGER, None)]
