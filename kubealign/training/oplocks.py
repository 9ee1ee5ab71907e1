"""Build locks of DeepSpeed's JIT-compiled ops that their owner left behind: detected and removed.

DeepSpeed compiles some ops on first use through torch.utils.cpp_extension.load; on the CPU,
`deepspeed.init_distributed` builds its shared-memory collectives op `deepspeed_shm_comm` in every process
(whatever the world size). torch serializes builders with a FileBaton: a `lock` file in the op's build dir
($TORCH_EXTENSIONS_DIR/<op>/lock, default ~/.cache/torch_extensions/py311_cpu/<op>/lock) created with
O_EXCL, held open for the build, removed at its end. Every load takes it, even of an op built already
(the check for changed sources runs under it), and a process that finds it waits until it disappears,
with no time limit and no message. A builder killed mid-build (SIGKILL, the OOM killer, a pod evicted)
never removes it: every later stage then hangs at 0 % CPU, silently.

How "the owner is gone" is told: the owner keeps the lock file open from its creation to its removal
(FileBaton.fd; the compiler it starts does not inherit it), and the kernel closes every file of a dead
process. So a lock that no process has open is stale: a scan of /proc/*/fd. Two observations of the same
file (device, inode, ctime), STALE_CONFIRM_S apart, both without a holder, are required: that rules out
the instants between FileBaton's open() and its fd showing in /proc, and between its close() and its
remove(). Cleaners serialize the second observation and the removal on an fcntl lock (which the kernel
releases if a cleaner dies), so when two ranks find the same stale lock, one removes it and the other
then sees the new builder's live lock, never removes that.

A lock that is held (a build running, e.g. by another rank on this node) is never removed: a stage waits
for the comm op's lock at most KUBEALIGN_OP_LOCK_WAIT_S seconds (default 1800; a CUDA op builds for
minutes), says after NOTICE_S which process it waits for, and then stops with an error naming the lock
and the process. While DeepSpeed may build (guard()), a watchdog thread keeps removing locks that become
stale, so an owner killed while this process waits in torch's own loop does not hang it either.

Where this cannot judge, it never removes and only waits, bounded: a build dir on a network filesystem
(the owner may run on another machine), and another user's lock when not root (that user's processes are
not ours to inspect). Processes in another PID namespace (another container sharing the dir through a
host path) are invisible to it: keep TORCH_EXTENSIONS_DIR per container, as the default is.

Where the ops go: torch's default, ~/.cache/torch_extensions/py311_cpu, is one directory for every Python
environment of the machine, and ninja rebuilds the op (a minute of every core) whenever a start from another
environment follows one (its headers' paths differ): two clones, or two users' environments, then rebuild it
in turn. So unless the user sets TORCH_EXTENSIONS_DIR, guard() sets it (for this process and all it starts) to
environment_dir(): inside a writable virtual environment (gone with it), else a directory of kubealign's cache
keyed by the environment's prefix and its Python, torch and DeepSpeed versions. The comm op then builds once
per environment, and guard() says so in one line while it does.

Rejected: an age bound (a build takes 20 s to many minutes: no bound is both safe and short); an fcntl
lock of our own around the build (it proves a FileBaton lock stale only if every builder takes it: the
live lock of another DeepSpeed program sharing the dir would be removed); skipping the op (DeepSpeed's CPU
backend builds it in every process, with no runtime switch). Prebuilding it when DeepSpeed is installed
(DS_BUILD_SHM_COMM=1) avoids the JIT build and its lock altogether and suits an image; a pip-installed
DeepSpeed builds on first use, which is what this module guards.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from kubealign.errors import UserError

log = logging.getLogger(__name__)

WAIT_ENV = "KUBEALIGN_OP_LOCK_WAIT_S"
DEFAULT_WAIT_S = 1800.0
STALE_CONFIRM_S = 1.0  # between the two observations of a lock without holder
NOTICE_S = 10.0  # wait this long for a live build before saying so
POLL_S = 1.0
COMM_OPS = ("deepspeed_shm_comm",)  # what DeepSpeed's CPU TorchBackend builds in init_distributed
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "9p", "afs")
LOCAL_FUSE = ("fuse.fuse-overlayfs", "fuse.lxcfs")  # a rootless container's own root: this machine only
CLEANERS = ".kubealign-oplocks"  # the cleaners' fcntl lock file, in the extensions root
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"


def environment_dir(prefix: str | None = None, base_prefix: str | None = None) -> Path:
    """kubealign's op directory for the Python environment at `prefix` (default: this one's, sys.prefix):
    `<venv>/torch-extensions` in a virtual environment this user may write to, else
    `$XDG_CACHE_HOME/kubealign/torch_extensions/<hash of the prefix, Python, torch and DeepSpeed versions>`."""
    from importlib import metadata

    prefix = sys.prefix if prefix is None else prefix
    base_prefix = sys.base_prefix if base_prefix is None else base_prefix
    if prefix != base_prefix and os.access(prefix, os.W_OK):
        return Path(prefix) / "torch-extensions"
    versions = [os.path.realpath(prefix), sys.version.split()[0]]
    for package in ("torch", "deepspeed"):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            versions.append("-")
    key = hashlib.sha256("\0".join(versions).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kubealign" / "torch_extensions" / key


def use_environment_dir() -> Path:
    """$TORCH_EXTENSIONS_DIR when the user set it, else set to environment_dir() (inherited by every process
    started from here on: the ranks, kfp.local's tasks); returns it."""
    if not os.environ.get(EXTENSIONS_ENV):
        os.environ[EXTENSIONS_ENV] = str(environment_dir())
    return Path(os.environ[EXTENSIONS_ENV])


def say_if_building(ops: Iterable[str], root: Path) -> None:
    """One line on stderr (from the first rank of the node) for each op of `ops` not built under `root` yet:
    its build, which DeepSpeed runs without a word, is why the stage is slow for a minute."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    for op in ops:
        if not (root / op / f"{op}.so").exists():
            name = op.removeprefix("deepspeed_")
            sys.stderr.write(
                f"kubealign: building DeepSpeed's {name} op for this environment (once, about a minute) into {root}\n"
            )
            sys.stderr.flush()


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds ops (its _get_build_directory without the op name)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = (
        f"rocm{torch.version.hip.replace('.', '')}"
        if torch.version.hip is not None
        else f"cu{torch.version.cuda.replace('.', '')}"
        if torch.version.cuda is not None
        else "cpu"
    )
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def lock_files(root: Path) -> list[Path]:
    """Every op build lock under `root` (one dir per op)."""
    try:
        return sorted(p for p in root.glob("*/lock") if p.is_file())
    except OSError:
        return []


def _identity(lock: Path) -> tuple[int, int, int] | None:
    try:
        st = lock.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def on_network_fs(path: Path) -> bool:
    """Whether `path` lies on a filesystem that other machines may share (longest mount point wins)."""
    target, best, fstype = str(path.resolve()), "", ""
    try:
        mounts = Path("/proc/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        return True  # cannot tell: treat as shared, i.e. never remove
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype in NETWORK_FS or (fstype.startswith("fuse.") and fstype not in LOCAL_FUSE)


def holders(lock: Path) -> list[int]:
    """The pids of the processes that have `lock` open. Processes whose fds this user may not read are
    skipped: a builder runs as the lock file's owner, whose processes are readable to that user and to root
    (see judgeable); what stays unreadable then is, e.g., a sandbox's init."""
    target = os.path.realpath(lock)
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fd_dir, links = f"/proc/{entry.name}/fd", []
        with contextlib.suppress(OSError):  # gone while we looked, or not ours to read
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    links.append(os.readlink(f"{fd_dir}/{fd}"))
        if target in links:
            pids.append(int(entry.name))
    return pids


def judgeable(lock: Path) -> bool:
    """Whether a lock without a holder in /proc has a dead owner: not when another machine may hold it
    (a network filesystem), nor when its owner is another user whose processes we may not inspect."""
    try:
        owner = lock.stat().st_uid
    except OSError:
        return False
    return (os.geteuid() in (0, owner)) and not on_network_fs(lock.parent)


def describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        argv = ""
    cmdline = " ".join(argv.replace("\0", " ").split())  # one line, whatever the arguments hold
    return f"process {pid}" + (f" ({cmdline[:100]})" if cmdline else "")


@contextlib.contextmanager
def _cleaners_lock(root: Path) -> Iterator[None]:
    fd = os.open(root / CLEANERS, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for two /proc scans at most, never while sleeping
        yield
    finally:
        os.close(fd)  # releases the flock


def clear_stale(root: Path | None = None, confirm_s: float = STALE_CONFIRM_S) -> list[Path]:
    """Remove every lock under `root` that no process holds, seen so twice `confirm_s` apart, with a
    warning for each; returns the removed locks. Locks that are held, or that cannot be judged, stay."""
    root = extensions_root() if root is None else root
    suspects = {}
    for lock in lock_files(root):
        if judgeable(lock) and not holders(lock):
            suspects[lock] = _identity(lock)
    if not suspects:
        return []
    time.sleep(confirm_s)
    removed = []
    try:
        with _cleaners_lock(root):
            for lock, seen in suspects.items():
                if seen is None or _identity(lock) != seen or holders(lock):
                    continue  # gone, replaced by a new builder's lock, or taken
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                    removed.append(lock)
                    log.warning(
                        "kubealign: removed the stale build lock %s: no process holds it (the build of "
                        "DeepSpeed's op %s was killed); the op is built again",
                        lock,
                        lock.parent.name,
                    )
    except OSError as exc:  # a read-only or foreign extensions dir
        names = ", ".join(str(p) for p in suspects)
        raise UserError(f"stale build lock(s) {names}: no process holds them, but cannot remove them: {exc}") from None
    return removed


def wait_for(ops: Iterable[str], root: Path | None = None, timeout: float | None = None) -> None:
    """Return once no lock of `ops` is held (stale ones are removed); a lock held longer than `timeout`
    (default: $KUBEALIGN_OP_LOCK_WAIT_S or 1800 s) stops with a UserError naming it and its holder."""
    root = extensions_root() if root is None else root
    if timeout is None:
        try:
            timeout = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
        except ValueError:
            raise UserError(f"{WAIT_ENV}={os.environ[WAIT_ENV]!r}: expected a number of seconds") from None
    started = time.monotonic()
    noticed = False
    for op in ops:
        lock = root / op / "lock"
        while lock.exists():
            pids = holders(lock)
            if not pids and judgeable(lock):
                clear_stale(root)
                continue
            waited = time.monotonic() - started
            who = ", ".join(describe(p) for p in pids) or "a process this machine cannot see or inspect"
            if waited >= timeout:
                raise UserError(
                    f"the DeepSpeed op {op} is still locked by {who} after {waited:.0f} s (lock file {lock}); "
                    f"if no build of it is running, remove that file; {WAIT_ENV} sets how long to wait"
                )
            if waited >= min(NOTICE_S, timeout / 2) and not noticed:
                noticed = True
                log.warning(
                    "kubealign: waiting for %s, which holds %s (building DeepSpeed's op %s), at most %.0f s",
                    who,
                    lock,
                    op,
                    timeout,
                )
            time.sleep(POLL_S)


@contextlib.contextmanager
def guard(ops: Iterable[str] = ()) -> Iterator[None]:
    """Around code where DeepSpeed may JIT-build ops: first wait (bounded) for the locks of `ops` and
    remove stale locks of any op; then, while the block runs, a watchdog thread removes locks that go
    stale (an owner killed while this process waits in torch's FileBaton.wait)."""
    ops = tuple(ops)
    root = use_environment_dir()
    wait_for(ops, root)
    clear_stale(root)
    say_if_building(ops, root)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_S):
            try:
                clear_stale(root)
            except Exception as exc:  # a watchdog must not kill the stage; the bounded pre-check stands
                log.debug("op lock watchdog: %s", exc)

    watchdog = threading.Thread(target=watch, name="kubealign-oplocks", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        stop.set()
        watchdog.join(timeout=10)
