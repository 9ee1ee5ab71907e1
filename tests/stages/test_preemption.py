"""Preemption (issue 35): a SIGTERM, what the kubelet sends before SIGKILL, makes a training stage save a
checkpoint at the next step boundary and stop with one line and exit 143; `--resume` then ends with exactly
the weights of an uninterrupted run. The handler, the ranks' agreement and the MLflow status by hand."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from kubealign.errors import Stopped
from kubealign.training import distributed, preemption
from tests.conftest import NO_TRACKING
from tests.stages.test_ppo import ppo_args, trained, without_timings  # noqa: F401  (trained: the module-scoped SFT + RM fixture)
from tests.stages.test_training import kubealign_subprocess, result_of, split_dir  # noqa: F401  (split_dir: a fixture)

TERM_AT = {"KUBEALIGN_FAULT_AT_STEP": "{}", "KUBEALIGN_FAULT_SIGNAL": "TERM"}


def term_at(step: int) -> dict[str, str]:
    return {k: v.format(step) for k, v in TERM_AT.items()}


def stopped_line(stage: str, where: str, checkpoint: Path) -> str:
    return (
        f"kubealign: {stage}: stopped by SIGTERM at {where}; checkpoint {checkpoint} kept: run the same command "
        "with --resume to continue from it"
    )


def no_temporary_output(tmp_path: Path) -> bool:
    return not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --- by hand -------------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_handler_sets_a_flag_and_a_second_signal_acts_as_before():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with preemption.StopRequest() as stop:
            assert stop.agreed() == 0
            signal.raise_signal(signal.SIGTERM)
            assert stop.agreed() == signal.SIGTERM and calls == []  # taken by the stage, not the old handler
            signal.raise_signal(signal.SIGTERM)  # the second: the previous handler's behaviour
            assert calls == [signal.SIGTERM]
        signal.raise_signal(signal.SIGTERM)  # after the stage: the previous handler again
        assert calls == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.unit
def test_every_rank_stops_for_a_signal_any_rank_got(monkeypatch):
    """This rank got nothing; the other rank a SIGINT, or both kinds: every rank reads the same answer."""
    for other, expected in (([0.0, 0.0], 0), ([0.0, 1.0], signal.SIGINT), ([1.0, 1.0], signal.SIGTERM)):
        monkeypatch.setattr(
            distributed, "all_reduce_sum", lambda v, o=other: [a + b for a, b in zip(v, o, strict=True)]
        )
        with preemption.StopRequest() as stop:
            assert stop.agreed() == expected
    with preemption.StopRequest() as stop:  # this rank a SIGINT, the other a SIGTERM: SIGTERM wins
        monkeypatch.setattr(distributed, "all_reduce_sum", lambda v: [v[0] + 1.0, v[1]])
        signal.raise_signal(signal.SIGINT)
        assert stop.agreed() == signal.SIGTERM


@pytest.mark.unit
def test_a_stopped_stage_ends_its_mlflow_run_killed(tmp_path: Path):
    from kubealign.config import load_config
    from kubealign.tracking.runs import stage_run
    from tests.tracking.test_tracking import SMALL, client_for

    with pytest.raises(Stopped), stage_run("sft", load_config(None, SMALL), tmp_path, required=False):
        raise preemption.stopped("sft", signal.SIGTERM, "step 3", "x.checkpoints/step3")
    client = client_for(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("kubealign-tiny").experiment_id])
    assert run.info.status == "KILLED"


# --- the stages ------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_sigterm_saves_stops_and_resumes_to_the_uninterrupted_weights(split_dir: Path, tmp_path: Path, stage):  # noqa: F811
    common = [
        stage,
        "--data",
        split_dir,
        "--set",
        NO_TRACKING,
        "--set",
        f"{stage}.num_train_epochs=0.3",
        "--set",
        f"{stage}.save_every_steps=4",
    ]
    straight = kubealign_subprocess(*common, "--output", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    stopped = kubealign_subprocess(*common, "--output", tmp_path / "run", env=term_at(6))
    saved = tmp_path / "run.checkpoints"
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == stopped_line(stage, "step 6", saved / "step6")
    assert "Traceback" not in stopped.stderr
    assert (saved / "latest").read_text() == "step6"  # saved at the stop, not only at the last interval (4)
    assert not (tmp_path / "run").exists() and no_temporary_output(tmp_path)
    resumed = kubealign_subprocess(*common, "--resume", "--output", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = result_of(tmp_path / "straight"), result_of(tmp_path / "run")
    assert a["history"][6:] == b["history"] and a["rank_param_sha256"] == b["rank_param_sha256"]
    assert not saved.exists()  # the finished stage removed its checkpoints


@pytest.mark.integration
def test_sigterm_stops_ppo_at_the_iteration_and_resumes_exactly(trained, tmp_path: Path):  # noqa: F811
    common = [
        *ppo_args(trained),
        "--set",
        NO_TRACKING,
        "--set",
        "ppo.num_iterations=5",
        "--set",
        "ppo.save_every_iterations=2",
        "--set",
        "ppo.ema_coef=0.9",
    ]
    straight = kubealign_subprocess(*common, "--output", tmp_path / "a")
    assert straight.returncode == 0, straight.stderr[-2000:]
    saved = tmp_path / "pvc" / "ppo"  # --checkpoints: where a pipeline task keeps them (on the PVC)
    stopped = kubealign_subprocess(*common, "--checkpoints", saved, "--output", tmp_path / "b", env=term_at(3))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1] == stopped_line("ppo", "iteration 3", saved / "iter3")
    assert (saved / "latest").read_text() == "iter3" and (saved / "actor" / "iter3" / "kubealign-ema.pt").is_file()
    assert not (tmp_path / "b").exists() and no_temporary_output(tmp_path)
    assert not (tmp_path / "b.checkpoints").exists()
    resumed = kubealign_subprocess(*common, "--checkpoints", saved, "--resume", "--output", tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = result_of(tmp_path / "a"), result_of(tmp_path / "b")
    assert without_timings(a["history"]) == without_timings(b["history"])
    assert a["rank_param_sha256"] == b["rank_param_sha256"]
    assert (tmp_path / "a" / "ema").is_dir() and a["metrics"]["reward_after"] == b["metrics"]["reward_after"]
    assert not saved.exists()


@pytest.mark.integration
@pytest.mark.multinode  # several ranks launched by torchrun: the multinode tier (make test-multinode), outside make test
def test_two_ranks_stop_together_when_one_gets_the_signal(trained, tmp_path: Path):  # noqa: F811
    """Only rank 0 is sent SIGTERM: both ranks learn of it at the same iteration boundary (one all_reduce),
    both save their shards of iteration 3 and stop, neither waits in a collective; the resumed two-rank run
    ends with the uninterrupted one's weights. torchrun itself reports its workers' exit as a failure (its
    own exit code 1, not 143): what a pod shows is torchrun's."""
    from tests.stages.test_training import launcher

    common = [
        *ppo_args(trained),
        "--set",
        NO_TRACKING,
        "--set",
        "ppo.actor_zero_stage=3",
        "--set",
        "ppo.critic_zero_stage=3",
        "--set",
        "ppo.num_iterations=4",
        "--set",
        "ppo.save_every_iterations=2",
    ]
    two = launcher("torchrun")
    straight = kubealign_subprocess(*common, "--output", tmp_path / "a", launcher=two)
    assert straight.returncode == 0, straight.stderr[-3000:]
    stopped = kubealign_subprocess(*common, "--output", tmp_path / "b", env=term_at(3), launcher=two)
    saved = tmp_path / "b.checkpoints"
    assert stopped.returncode != 0
    assert stopped.stderr.count(stopped_line("ppo", "iteration 3", saved / "iter3")) == 2, stopped.stderr[-3000:]
    assert (saved / "latest").read_text() == "iter3" and not (tmp_path / "b").exists()
    resumed = kubealign_subprocess(*common, "--resume", "--output", tmp_path / "b", launcher=two)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = result_of(tmp_path / "a"), result_of(tmp_path / "b")
    assert a["rank_param_sha256"] == b["rank_param_sha256"] and len(set(a["rank_param_sha256"])) == 1
