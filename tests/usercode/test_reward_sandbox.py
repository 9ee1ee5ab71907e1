"""The reward-function worker against an adversary (issue 54), as a pod runs it: a trainer process of a non-root
uid holding credentials in its environment, and a function that tries each way out. Each probe is a function
that reports whether its escape worked; each of them worked before the sandbox (kubealign.usercode.sandbox).

Run here as root, the trainer is started by util-linux's `setpriv` as uid/gid 65534 with one capability
kept, CAP_DAC_READ_SEARCH, only so that it can read this machine's interpreter under /root (mode 0700); it
grants no write, no ptrace and no network. Run as another user, the trainer is that user.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kubealign.usercode import sandbox

pytestmark = pytest.mark.faults

SECRET = "probe-secret-4f1c"
NOBODY = 65534

PROBES = """
import os, socket, sys, time

def parent_environ(prompts, completions, **columns):
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            return [float(b"SECRET" in f.read())]
    except OSError:
        return [0.0]

def parent_cwd(prompts, completions, **columns):
    try:
        with open(f"/proc/{os.getppid()}/cwd/escaped.txt", "w") as f:
            f.write("x")
        return [1.0]
    except OSError:
        return [0.0]

def finished_output(prompts, completions, **columns):
    try:
        with open("OUTPUT/model.safetensors", "w") as f:
            f.write("overwritten")
        return [1.0]
    except OSError:
        return [0.0]

def connects(prompts, completions, **columns):
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=5).close()
        return [1.0]
    except OSError:
        return [0.0]

def big_file(prompts, completions, **columns):
    with open("big.bin", "wb") as f:
        for _ in range(3):
            f.write(b"x" * 2**20)
    return [1.0]

def prints_a_lot(prompts, completions, **columns):
    block = "y" * 2**20
    for _ in range(80):
        sys.stderr.write(block)
    print("THE END")
    return [1.0]

def half_a_reply(prompts, completions, **columns):
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if fd > 2 and os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                os.write(fd, b'{"values": [1.0')
        except OSError:  # the listing's own descriptor, closed by now
            pass
    time.sleep(600)
"""

TRAINER = """
import json, resource, sys
from kubealign.config.schema import RewardsConfig
from kubealign.errors import UserError
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner

name, directory, network, file_limit_mb = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
rewards = RewardsConfig(
    functions=[{"path": f"probes.py:{name}"}], timeout_s=5, file_limit_mb=file_limit_mb, network=network
)
specs = definitions.resolve(rewards, directory)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    with FunctionRunner.for_config(specs, rewards) as runner:
        out = {"values": runner.call(runner.specs[0], ["p"], ["c"], {}, ["d.jsonl:1"]), "confined": runner.confined}
except UserError as exc:
    out = {"error": str(exc)}
out["rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def place():
    """A directory the trainer's uid owns: its working directory (the stage's), a finished output of another
    stage it could write, and the probes; a TCP listener on 127.0.0.1."""
    if sandbox.landlock_abi() < 4:
        pytest.skip(f"the kernel offers Landlock ABI {sandbox.landlock_abi()}; these probes need 4 (TCP rules)")
    as_root = os.geteuid() == 0
    if as_root and shutil.which("setpriv") is None:
        pytest.skip("running as root without util-linux's setpriv: cannot start the trainer as a non-root uid")
    root = Path(tempfile.mkdtemp(prefix="kubealign-sandbox-"))
    os.chmod(root, 0o755)
    for sub in ("stage", "sft-output"):
        (root / sub).mkdir()
    (root / "sft-output" / "model.safetensors").write_text("weights")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    probes = PROBES.replace("OUTPUT", str(root / "sft-output")).replace("PORT", str(listener.getsockname()[1]))
    (root / "stage" / "probes.py").write_text(probes, encoding="utf-8")
    (root / "trainer.py").write_text(TRAINER, encoding="utf-8")
    if as_root:
        for path in [root, *root.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    yield root, as_root
    listener.close()
    shutil.rmtree(root, ignore_errors=True)


def trainer(place, name: str, network: bool = False, file_limit_mb: int = 1024) -> dict:
    """The trainer (uid 65534 here) calling one probe, with credentials in its environment."""
    root, as_root = place
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(root),
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "MLFLOW_TRACKING_PASSWORD": SECRET,
        "SECRET": SECRET,
        "KUBEALIGN_CACHE_DIR": str(root / "cache"),
    }
    argv = [sys.executable, str(root / "trainer.py"), name, str(root / "stage"), "1" if network else "0"]
    argv.append(str(file_limit_mb))
    if as_root:
        keep = ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *keep, *argv]
    done = subprocess.run(argv, env=env, cwd=root / "stage", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["stderr"] = done.stderr
    return out


def test_the_trainers_environment_and_working_directory_are_out_of_reach(place) -> None:
    root, _ = place
    assert trainer(place, "parent_environ")["values"] == [0.0]
    assert trainer(place, "parent_cwd")["values"] == [0.0]
    assert not (root / "stage" / "escaped.txt").exists()


def test_it_writes_nowhere_but_its_own_directory(place) -> None:
    root, _ = place
    out = trainer(place, "finished_output")
    assert out["values"] == [0.0] and "writes only in its directory" in out["confined"]
    assert (root / "sft-output" / "model.safetensors").read_text() == "weights"


def test_no_network_unless_the_config_asks_for_it(place) -> None:
    assert trainer(place, "connects")["values"] == [0.0]
    assert trainer(place, "connects", network=True)["values"] == [1.0]


def test_a_file_past_the_size_limit_is_the_functions_error(place) -> None:
    assert trainer(place, "big_file")["values"] == [1.0]  # 3 MiB: room for it under the default
    out = trainer(place, "big_file", file_limit_mb=2)
    assert out["error"].startswith("reward function big_file (rewards.functions[0].path): raised OSError: [Errno 27]")


def test_what_it_prints_is_read_from_its_tail_only(place) -> None:
    """80 MiB printed in one call: the trainer's peak memory grows by far less (it read the last 64 KiB)."""
    out = trainer(place, "prints_a_lot")
    assert out["values"] == [1.0] and "THE END" in out["stderr"]
    assert out["rss_growth_mib"] < 16, out["rss_growth_mib"]


def test_half_a_reply_is_a_timeout_not_a_hang(place) -> None:
    out = trainer(place, "half_a_reply")
    assert out["error"] == (
        "reward function half_a_reply (rewards.functions[0].path): no answer within rewards.timeout_s 5 s "
        "(a batch of 1 rows starting at d.jsonl:1); stopped"
    )
