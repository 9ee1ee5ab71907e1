"""A lease the registry itself holds: concurrent promotes (and rollbacks) of one registered model take
turns.

The lease is the registered model `<name>.promotion-lease`: `create_registered_model` is an insert under a
unique key in the registry's database, so exactly one of several concurrent creates succeeds
(RESOURCE_ALREADY_EXISTS for the others) on every MLflow backend with a database; a tag written and read
back could not do that (last writer wins). Its tags name the owner (host:pid:nonce) and expiry; the holder
deletes it when done. A waiter breaks a lease whose expiry has passed, or whose owner was a process on this
host that no longer exists; otherwise it waits up to LEASE_WAIT_S. Breaking is check-then-delete, so it
assumes a holder older than LEASE_TTL_S is dead (kubealign.promotion.versions fences the one case where
that matters). MLflow's file store creates a registered model by check-then-mkdir, not atomically: there
a file lock beside the store (filelock) is taken as well.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubealign.errors import UserError
from kubealign.promotion.aliases import error_code

LEASE_SUFFIX = ".promotion-lease"
LEASE_TTL_S = 300  # a lease older than this is taken to be from a dead promote (it holds it for seconds)
LEASE_WAIT_S = 330  # > LEASE_TTL_S: a waiter always outlives a dead holder's lease
LEASE_POLL_S = 0.5
CLOCK_SKEW_S = 60  # between hosts: a lease expiring further ahead than TTL + this was not set by a promote


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


def refuse_foreign(lock: str, holder: dict[str, str]) -> None:
    """A lease no kubealign promote wrote (an expiry further ahead than any promote sets, or no owner of the
    form host:pid[:nonce]) is somebody's squat, not a holder to wait for: one line, at once (otherwise the
    chart's reader identity could create it and make every promote wait LEASE_WAIT_S, then fail)."""
    if "owner" not in holder or "expires" not in holder:
        return  # a create whose tags are not in yet (MLflow's SQL store writes them apart): wait for it
    owner, expires = holder["owner"], holder["expires"]
    try:
        too_far = float(expires) > time.time() + LEASE_TTL_S + CLOCK_SKEW_S
    except ValueError:
        too_far = True
    host, _, rest = owner.partition(":")
    if too_far or not (host and rest.partition(":")[0].isdigit()):
        name = lock.removesuffix(LEASE_SUFFIX)
        raise UserError(
            f"registered model {name}: its lease {lock} was not written by a kubealign promote (owner {owner!r}, "
            f"expires {expires!r}); its creator or the registry's admin must delete {lock}"
        )


def break_dead(client: Any, lock: str, holder: dict[str, str]) -> None:
    """Delete a dead holder's lease; a delete this identity may not make is one line naming who can."""
    try:
        client.delete_registered_model(lock)
    except Exception as exc:
        if error_code(exc) == "PERMISSION_DENIED":
            name = lock.removesuffix(LEASE_SUFFIX)
            raise UserError(
                f"registered model {name}: the expired lease {lock} (owner {holder.get('owner')!r}) may not be "
                f"deleted by this identity (403); its creator or the registry's admin must delete it"
            ) from None
        # another waiter broke it first, or the registry hiccuped: the next try sees


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
            # again. (Seen on PostgreSQL: 5 of 120 takes racing a release; tests/faults/test_production_stores.py.)
            return False
        if error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise
    holder = lease_tags(client, lock)
    if holder is None:  # released in between: try again
        return False
    if holder.get("owner") == owner:  # our create landed but its answer was lost; MLflow's retry was refused
        return True
    refuse_foreign(lock, holder)
    if holder_is_dead(holder):
        break_dead(client, lock, holder)
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
