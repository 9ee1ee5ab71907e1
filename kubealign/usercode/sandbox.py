"""What the reward-function worker does to itself before it loads any user code, and what the
trainer does while a worker runs.

The worker (kubealign.usercode.worker) calls `confine`:
- RLIMIT_FSIZE: no file it writes grows past `file_limit_mb` (the write fails with EFBIG; SIGXFSZ is
  ignored so that the failure is the function's error, not a dead worker).
- PR_SET_CHILD_SUBREAPER: a process it starts that detaches (a new session, a double fork) is re-parented to
  the worker, not to init, so the trainer finds every descendant under the worker and ends it with the call.
- Landlock (Linux >= 5.13; the kernel's own unprivileged sandbox, no capability needed, inherited by every
  descendant and never undone): writes (create, write, truncate, remove, rename, link) only beneath the
  worker's private directory and to /dev/null; no TCP connect or bind unless `network` (ABI >= 4); no
  signals to, and no abstract unix sockets of, processes outside the sandbox (ABI >= 6). A sandboxed process
  also cannot ptrace, and so cannot read the /proc/PID/environ, /proc/PID/cwd or /proc/PID/mem of, any
  process outside it — as long as it holds no CAP_SYS_PTRACE, which a worker of a root trainer would: it gives
  up every capability but reading files after Landlock (`drop_capabilities`), so the trainer's credentials are
  out of reach by that path for root too.
- Landlock also handles reads: they are granted beneath everything but kubealign's cache (the canary fronts'
  tokens), by a rule on each entry of each directory on the way to it but the one leading there.
- seccomp (`socket_filter`, without rewards.network): socket(2) refused for every family but netlink routing,
  socketpair(2) but for unix stream pairs, io_uring altogether — Landlock's network rules cover TCP only.
Other reads stay open (a function reads its own data and Python's libraries); what it could read is what the
task's user can read, minus other processes' /proc entries and kubealign's cache.

The trainer calls `undumpable` while a worker runs: a non-dumpable process's /proc entries belong to root,
so a worker of the same non-root uid cannot open them even where Landlock is missing.

`landlock_abi()` says what the kernel offers; `confine` returns a one-line account of what holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import struct
import sys
from pathlib import Path

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same numbers on x86-64 and arm64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER, _PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 38, 36, 3, 4

# Landlock's file-system rights that change something (linux/landlock.h: bit 0 execute, 2 read file, 3 read
# dir and 15 ioctl are the others, left unhandled: reads stay open), and the ABI that added each
_FS_WRITE_FILE, _FS_REMOVE_DIR, _FS_REMOVE_FILE, _FS_MAKE_CHAR, _FS_MAKE_DIR = 1 << 1, 1 << 4, 1 << 5, 1 << 6, 1 << 7
_FS_MAKE_REG, _FS_MAKE_SOCK, _FS_MAKE_FIFO, _FS_MAKE_BLOCK, _FS_MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_FS_READ_FILE, _FS_READ_DIR = 1 << 2, 1 << 3
_WRITES_ABI1 = (
    _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE_CHAR | _FS_MAKE_DIR | _FS_MAKE_REG
    | _FS_MAKE_SOCK | _FS_MAKE_FIFO | _FS_MAKE_BLOCK | _FS_MAKE_SYM
)  # fmt: skip
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_libc = ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _prctl(option: int, value: int) -> int:
    result = _libc.prctl(option, value, 0, 0, 0)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def landlock_abi() -> int:
    """The Landlock ABI version the kernel offers; 0 where it has none (or a seccomp filter hides it)."""
    try:
        return _syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    except (OSError, AttributeError):
        return 0


def write_rights(abi: int) -> int:
    """Every right that changes the file system, as far as the kernel's ABI names them."""
    rights = _WRITES_ABI1
    if abi >= 2:
        rights |= _FS_REFER
    if abi >= 3:
        rights |= _FS_TRUNCATE
    return rights


def _ruleset(abi: int, network: bool) -> bytes:
    """struct landlock_ruleset_attr for `abi`: its size grew with each ABI (fs, then net, then scoped)."""
    handled_fs = write_rights(abi) | _FS_READ_FILE | _FS_READ_DIR
    if abi < 4:
        return struct.pack("=Q", handled_fs)
    handled_net = 0 if network else _NET_BIND_TCP | _NET_CONNECT_TCP
    if abi < 6:
        return struct.pack("=QQ", handled_fs, handled_net)
    return struct.pack("=QQQ", handled_fs, handled_net, _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)


def _allow_beneath(ruleset_fd: int, path: Path, rights: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr is packed
        _syscall(_SYS_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, ctypes.c_char_p(rule), 0)
    finally:
        os.close(fd)


def _allow_reads_but(ruleset_fd: int, hidden: Path) -> str:
    """Read access beneath everything but `hidden` (kubealign's cache: the canary fronts' tokens, the built
    models): beneath every entry of each directory from / down to it but the one on the way, then the paths the
    interpreter imports from that lie inside it. In a line, what holds. Landlock grants, never refuses, so the
    hidden directory is what no rule reaches; an entry made beside the way after this call is unreadable too."""
    way, here = hidden.resolve().parts, Path("/")
    try:
        for name in way[1:]:
            for entry in os.scandir(here):
                if entry.name != name and not entry.is_symlink():  # a link's target is reached by its own path
                    rights = _FS_READ_FILE | _FS_READ_DIR if entry.is_dir() else _FS_READ_FILE
                    with contextlib.suppress(OSError):  # gone meanwhile, or a file Landlock takes no rule on
                        _allow_beneath(ruleset_fd, Path(entry.path), rights)
            here = here / name
            if not here.is_dir():  # not made yet: whenever it is, nothing grants it
                break
    except OSError as exc:  # a directory on the way that cannot be listed: every read stays open
        _allow_beneath(ruleset_fd, Path("/"), _FS_READ_FILE | _FS_READ_DIR)
        return f"kubealign's cache not confined ({exc.strerror}: {exc.filename})"
    inside = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p]
    for path in inside:  # an interpreter or a module directory kept in the cache stays importable
        if path.is_relative_to(hidden.resolve()) and path != hidden.resolve() and path.exists():
            _allow_beneath(ruleset_fd, path, _FS_READ_FILE | _FS_READ_DIR)
    return f"nothing read under {hidden}"


def _landlock(home: Path, network: bool, hidden: Path | None = None) -> str:
    abi = landlock_abi()
    if abi < 1:
        return "no Landlock in this kernel: writes, network, reads of kubealign's cache and /proc not confined"
    attr = _ruleset(abi, network)
    reads = _FS_READ_FILE | _FS_READ_DIR
    ruleset_fd = _syscall(_SYS_CREATE_RULESET, ctypes.c_char_p(attr), len(attr), 0)
    try:
        _allow_beneath(ruleset_fd, home, write_rights(abi) | reads)
        _allow_beneath(
            ruleset_fd, Path("/dev/null"), _FS_WRITE_FILE | _FS_READ_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
        )
        if hidden is None:
            _allow_beneath(ruleset_fd, Path("/"), reads)
            secrets = "reads open"
        else:
            secrets = _allow_reads_but(ruleset_fd, hidden)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # what an unprivileged process must set before it restricts itself
        _syscall(_SYS_RESTRICT_SELF, ruleset_fd, 0)
    finally:
        os.close(ruleset_fd)
    net = "network open (rewards.network)" if network else "no TCP" if abi >= 4 else "network open (Landlock ABI < 4)"
    return f"Landlock ABI {abi}: writes only in its directory, {secrets}, {net}"


def confine(home: Path, file_limit_mb: int, network: bool, hidden: Path | None = None) -> str:
    """Limit this process (the worker, before any user code) and everything it starts; what holds, in a line.
    hidden: a directory none of it may read (kubealign's cache)."""
    limit = file_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), the worker lives
    try:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux: only the process group is ended
        return "not Linux: no sandbox but the file-size limit"
    landlocked = _landlock(home, network, hidden)
    sockets = "sockets open (rewards.network)" if network else socket_filter()
    return f"{landlocked}; {sockets}; {drop_capabilities()}"


# seccomp's classic BPF (linux/filter.h, linux/seccomp.h) and the system calls it looks at, per architecture
_LD_W_ABS, _JEQ, _JGE, _AND, _RET = 0x20, 0x15, 0x35, 0x54, 0x06
_ALLOW, _DENY = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW; SECCOMP_RET_ERRNO with EACCES
_ARCHES = {  # machine: (AUDIT_ARCH_*, socket, socketpair, io_uring_setup)
    "x86_64": (0xC000003E, 41, 53, 425),
    "aarch64": (0xC00000B7, 198, 199, 425),
}
_AF_UNIX, _AF_NETLINK, _SOCK_STREAM, _SOCK_TYPE_MASK = 1, 16, 1, 0xF
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


def _socket_program(arch: int, socket_nr: int, pair_nr: int, uring_nr: int) -> list[tuple[int, int, int, int]]:
    """(code, jump if true, jump if false, k) instructions: socket(2) refused (EACCES) for every family but
    netlink's routing protocol (what getaddrinfo asks about the machine's own addresses), socketpair(2) for all
    but a unix stream pair (asyncio's and multiprocessing's pipes: connected to each other, to nothing else),
    io_uring refused (it opens sockets without socket(2)), and any other architecture's system calls refused."""
    nr, args = 0, lambda i: 16 + 8 * i  # offsets in struct seccomp_data: nr, arch at 4, args[i] (the low word)
    return [
        (_LD_W_ABS, 0, 0, 4),
        (_JEQ, 0, 16, arch),  # -> deny
        (_LD_W_ABS, 0, 0, nr),
        (_JGE, 14, 0, 0x40000000),  # x86-64's x32 numbers -> deny
        (_JEQ, 3, 0, socket_nr),  # -> socket
        (_JEQ, 6, 0, pair_nr),  # -> socketpair
        (_JEQ, 11, 0, uring_nr),  # -> deny
        (_RET, 0, 0, _ALLOW),
        (_LD_W_ABS, 0, 0, args(0)),  # socket: the family
        (_JEQ, 0, 8, _AF_NETLINK),  # -> deny
        (_LD_W_ABS, 0, 0, args(2)),  # the protocol: NETLINK_ROUTE is 0
        (_JEQ, 5, 6, 0),  # -> allow, deny
        (_LD_W_ABS, 0, 0, args(0)),  # socketpair: the family
        (_JEQ, 0, 4, _AF_UNIX),  # -> deny
        (_LD_W_ABS, 0, 0, args(1)),  # the type, without SOCK_NONBLOCK and SOCK_CLOEXEC
        (_AND, 0, 0, _SOCK_TYPE_MASK),
        (_JEQ, 0, 1, _SOCK_STREAM),  # -> allow, deny
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _DENY),
    ]


def socket_filter() -> str:
    """Install the seccomp filter of `_socket_program` on this process and everything it starts (never undone),
    in a line. Landlock's network rules cover TCP only (ABI 4+): without it a function sent UDP to 127.0.0.1 and
    connected to a unix socket by its path with the network off. seccomp needs no privilege once no_new_privs is
    set, and container runtimes' default profiles let a process add a filter of its own."""
    import platform

    machine = platform.machine()
    if machine not in _ARCHES:
        return f"sockets not confined (no seccomp program for {machine})"
    program = b"".join(struct.pack("=HBBI", *op) for op in _socket_program(*_ARCHES[machine]))
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    try:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        result = _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0)
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        return f"sockets not confined (seccomp: {getattr(exc, 'strerror', exc)})"
    return "no socket but unix stream pairs and netlink routes (seccomp)"


_SYS_CAPGET, _SYS_CAPSET = 125, 126  # x86-64 (arm64: 90, 91)
_PR_CAPBSET_DROP, _CAP_LAST_CAP = 24, 63
_CAPABILITY_VERSION_3 = 0x20080522
# kept: reading any file (reads stay open by design; a test harness runs the trainer as nobody with only this,
# to read an interpreter under /root); it opens no /proc entry of a non-dumpable process, which takes ptrace
_KEPT = 1 << 2  # CAP_DAC_READ_SEARCH


def drop_capabilities() -> str:
    """Give up every capability but CAP_DAC_READ_SEARCH, now and for anything started after (the bounding set),
    in a line. A worker of a trainer running as root would otherwise keep CAP_SYS_PTRACE and read the trainer's
    /proc/PID/environ (its credentials) although the trainer is non-dumpable while it runs, Landlock
    notwithstanding (measured: Landlock ABI 7, root; tests/usercode/test_tool_worker.py). A non-root worker has
    none to give up."""
    import platform

    capget, capset = (_SYS_CAPGET, _SYS_CAPSET) if platform.machine() in ("x86_64", "AMD64") else (90, 91)
    for cap in range(_CAP_LAST_CAP + 1):  # the bounding set first: it needs CAP_SETPCAP, which goes next
        if not _KEPT >> cap & 1:
            # past the kernel's last capability, or no CAP_SETPCAP (then none to drop anyway): nothing to do
            with contextlib.suppress(OSError):
                _prctl(_PR_CAPBSET_DROP, cap)
    header = struct.pack("=Ii", _CAPABILITY_VERSION_3, 0)
    try:
        now = ctypes.create_string_buffer(24)  # two {effective, permitted, inheritable} u32 triples
        _syscall(capget, ctypes.c_char_p(header), now)
        low = struct.unpack("=6I", now.raw)
        kept = [v & _KEPT if i < 3 else 0 for i, v in enumerate(low)]  # the second triple: capabilities 32-63
        _syscall(capset, ctypes.c_char_p(header), ctypes.c_char_p(struct.pack("=6I", *kept)))
        _syscall(capget, ctypes.c_char_p(header), now)
    except OSError as exc:
        return f"capabilities kept ({exc.strerror})"
    left = struct.unpack("=6I", now.raw)
    return "no capabilities" if not any(left) else "no capability but reading files"


def undumpable() -> int:
    """Make this process (the trainer) non-dumpable; its previous setting, for `restore_dumpable`."""
    previous = _prctl(_PR_GET_DUMPABLE, 0)
    _prctl(_PR_SET_DUMPABLE, 0)
    return previous


def restore_dumpable(previous: int) -> None:
    _prctl(_PR_SET_DUMPABLE, previous)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children first-level first), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]  # the name in parentheses may hold spaces
        if state != "Z":  # a zombie is dead already: its parent reaps it
            children.setdefault(int(ppid), []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def end_tree(pid: int, rounds: int = 20) -> None:
    """SIGKILL everything under `pid` (the worker is their subreaper, so a detached one is still under it),
    again until nothing is left (a process may fork while it is being killed), then `pid` itself."""
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            break
        for child in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
