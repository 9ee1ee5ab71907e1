"""Ranks that finish generating apart, with the actor at ZeRO-3 on two ranks (DeepSpeed #8321: a rank that
stops generating leaves the other waiting in the all-gather of its next decode forward). Two gloo ranks on CPU
under torchrun (tests/rl/zero3_ranks.py): responses of different lengths on each rank, in a single-turn rollout
and in a multi-turn one whose trajectories take 1 turn on one rank and 3 on the other. A hang is bounded by the
subprocess timeout; both ranks must finish, with the same number of forwards (every gather matched).

Caught, when broken on purpose: generate without synced_gpus (single: rank 1 stops in a gather of rank 0's
missing forwards, timed out); multiturn.rollout before the lockstep turns (multi: timed out at 120 s)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.support import launchers

pytestmark = pytest.mark.multinode

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"rank (\d) of 2: partitioned (\w+), forwards (\d+), turns \[([\d, ]+)\]")


def run_ranks(case: str) -> dict[int, tuple[str, int, list[int]]]:
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tests.rl.zero3_ranks", case]
    try:
        done = launchers.run(command, timeout=120, cwd=ROOT)
    except launchers.TimedOut as exc:  # the hang: the ranks' collectives no longer line up
        pytest.fail(f"{case}: the two ranks did not finish ({exc}; a rank waits in a gather)")
    assert done.returncode == 0, done.stderr[-3000:]
    found = {int(m[1]): (m[2], int(m[3]), [int(x) for x in m[4].split(",")]) for m in LINE.finditer(done.stdout)}
    assert sorted(found) == [0, 1], done.stdout[-2000:]
    return found


def test_single_turn_ranks_that_end_apart_run_the_same_forwards():
    ranks = run_ranks("single")
    assert ranks[0][0] == ranks[1][0] == "True"  # the weights really are partitioned: each forward gathers
    # rank 1's rows end at decode step 5 (6 forwards); rank 0's at step 0, then it keeps stepping with rank 1
    assert ranks[0][1] == ranks[1][1] == 6


def test_multi_turn_ranks_that_take_different_turns_stay_in_lockstep():
    ranks = run_ranks("multi")
    assert ranks[0][2] == [1, 1] and ranks[1][2] == [3, 3]  # each rank's trajectories kept their own turns
    assert ranks[0][1] == ranks[1][1]  # rank 0 ran idle turns alongside rank 1's 2nd and 3rd
