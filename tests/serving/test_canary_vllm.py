"""The canary online, for real (issue 39): `kubealign serve --canary` runs the champion's and the challenger's
vLLM servers behind its traffic split, and `kubealign judge --front --act` judges the challenger on the
held-out prompts through their HTTP endpoints with the honest reward model, then carries the verdict out in
the registry and in what is served.

Its own tier (marker vllm, `make test-serve`): each `kubealign serve --canary` starts two vLLM servers (40-100
s each on 2 cores). The models are trained here: the SFT policy is the champion; PPO against a sabotaged reward
model (its score head negated, as in test_evaluate's gate test) is a challenger whose offline evaluation
passed (written by hand: the sabotage fooled it); PPO against the honest one is a good challenger.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from kubealign.ranks import RENDEZVOUS_ENV
from tests.conftest import NO_TRACKING
from tests.faults.test_faults_registry import aliases, evaluation
from tests.serving.test_serve_vllm import KUBEALIGN, READY_LIMIT_S
from tests.stages.test_evaluate import sabotaged_copy
from tests.stages.test_ppo import trained  # noqa: F401 (data-split, a half-trained SFT policy, the honest reward model)
from tests.support.faults import free_port
from tests.support.stores import process_env

pytestmark = pytest.mark.vllm

NAME = "canary-actor"
PROMPTS = 16


def kubealign(uri: str, *args: object, timeout: float = 900) -> str:
    """`kubealign ARGS` as its own process against the registry at uri; its stdout (a failure shows stderr).
    Without this process's rendezvous (the fixture trained in-process: its process group holds MASTER_PORT)."""
    env = {k: v for k, v in process_env({"MLFLOW_TRACKING_URI": uri}).items() if k not in RENDEZVOUS_ENV}
    done = subprocess.run([str(KUBEALIGN), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def register(uri: str, root: Path, model: Path, mode: str, i: int) -> None:
    """`kubealign promote` of `model` with an offline evaluation that passed the gate, in `mode`."""
    kubealign(
        uri,
        "promote",
        "--evaluation",
        evaluation(root, f"e{i}", 0.8, 0.4, 1.0 + i),
        "--model-dir",
        model,
        "--output",
        root / f"p{i}",
        "--set",
        f"promote.registered_model={NAME}",
        "--set",
        f"promote.mode={mode}",
    )


class Serving:
    """`kubealign serve --canary challenger` (50 %) on a free port, until its ready line."""

    def __init__(self, uri: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(KUBEALIGN),
            "serve",
            "--tracking-uri",
            uri,
            "--model",
            NAME,
            "--port",
            str(self.port),
            "--canary",
            "challenger",
            "--canary-percent",
            "50",
        ]
        env = {k: v for k, v in process_env({}).items() if k not in RENDEZVOUS_ENV}
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.printed = ""
        try:
            self.wait_for("judge it: kubealign judge --front", READY_LIMIT_S)
        except BaseException:  # never leave two vLLM servers behind
            self.stop()
            raise

    def wait_for(self, text: str, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while text not in self.printed:
            assert self.proc.poll() is None, self.printed[-3000:]
            assert time.monotonic() < deadline, self.printed[-3000:]
            # os.read, not readline: a text file's buffer may hold lines that select no longer sees
            if select.select([self.proc.stdout], [], [], 5)[0]:
                self.printed += os.read(self.proc.stdout.fileno(), 65536).decode(errors="replace")

    def who_answers(self, n: int) -> list[str]:
        """The x-kubealign-served label of n completions through the front."""
        labels = []
        for _ in range(n):
            body = json.dumps({"model": NAME, "prompt": "\n\nHuman: Hi\n\nAssistant:", "max_tokens": 4}).encode()
            request = urllib.request.Request(
                f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as reply:
                labels.append(reply.headers["x-kubealign-served"])
        return labels

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        self.printed += self.proc.communicate(timeout=120)[0].decode(errors="replace")


def test_a_sabotaged_challenger_is_rolled_back_online_and_a_good_one_promoted_and_served_alone(
    trained,  # noqa: F811
    tmp_path: Path,
) -> None:
    import yaml
    from mlflow.tracking import MlflowClient

    from kubealign.serving.carry_out import REJECTED_TAG

    bad_rm = sabotaged_copy(trained["rm"], tmp_path / "bad-rm")
    fast = ["--set", NO_TRACKING, "--set", "ppo.num_iterations=10", "--set", "ppo.actor_learning_rate=3e-4"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # the good challenger trains as the demo's does (the preset's 30 iterations at its learning rate): 10 at 3e-4
    # made answers that repeat bigrams (0.60 of them against the champion's 0.00), which the online gate's
    # degeneration guard rightly refused
    honest = ["--set", NO_TRACKING]
    for out, critic, sets in (("ppo-bad", bad_rm, fast), ("ppo-good", trained["rm"], honest)):
        kubealign(
            uri,
            "ppo",
            "--prompts",
            trained["split"],
            "--actor",
            trained["sft"],
            "--critic",
            critic,
            *sets,
            "--output",
            tmp_path / out,
        )
    register(uri, tmp_path, trained["sft"], "direct", 1)
    register(uri, tmp_path, tmp_path / "ppo-bad", "canary", 2)
    assert aliases(uri, NAME) == {"champion": "1", "challenger": "2"}
    doc = {
        "promote": {"registered_model": NAME},
        "tracking": {"enabled": False},
        "canary": {"prompts": PROMPTS, "min_answers": PROMPTS},
    }
    (tmp_path / "judge.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")

    def judge(front: str, out: str) -> dict:
        printed = kubealign(
            uri,
            "judge",
            "--config",
            tmp_path / "judge.yaml",
            "--front",
            front,
            "--prompts",
            trained["split"],
            "--tokenizer",
            trained["sft"],
            "--reward",
            trained["rm"],
            "--act",
            "--output",
            tmp_path / out,
        )
        print(f"\n{printed}")
        return {"printed": printed, **json.loads((tmp_path / out / "result.json").read_text())}

    serving = Serving(uri)
    try:
        assert serving.who_answers(4) == ["champion@1", "challenger@2", "champion@1", "challenger@2"]
        bad = judge(serving.url, "judge-bad")
        serving.wait_for("the server of version 2 stopped", 120)
        assert serving.who_answers(4) == ["champion@1"] * 4  # the served model unchanged, alone
    finally:
        serving.stop()
    m = bad["metrics"]
    assert not bad["promoted"] and m["prompts"] == PROMPTS and m["canary/errors"] == 0
    assert m["reward_gain"] < 0 and m["win_rate"] < 0.5  # the honest reward model sees what the sabotage did
    assert f"serving: {serving.url} updated: version 1 alone" in bad["printed"]
    assert aliases(uri, NAME) == {"champion": "1"}
    assert MlflowClient(uri).get_model_version(NAME, "2").tags[REJECTED_TAG] == "rejected"

    register(uri, tmp_path, tmp_path / "ppo-good", "canary", 3)
    assert aliases(uri, NAME) == {"champion": "1", "challenger": "3"}
    serving = Serving(uri)
    try:
        good = judge(serving.url, "judge-good")
        serving.wait_for("the server of version 1 stopped", 120)
        assert serving.who_answers(4) == ["challenger@3"] * 4  # the canary is the whole service now
    finally:
        serving.stop()
    assert good["promoted"] and good["metrics"]["reward_gain"] > 0, good["verdict"]
    assert aliases(uri, NAME) == {"champion": "3", "previous-champion": "1"}
