"""Promotion through a real MLflow registry: a sqlite store and an `mlflow server` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from kubealign import __version__
from kubealign.models import loading
from tests.faults.test_faults_registry import GUARD_FIGURES

pytestmark = pytest.mark.integration


def evaluation(root: Path, name: str, win: float, gain: float, reward: float, kl: float = 1.0) -> Path:
    """An evaluate-stage output (its result.json is promote's whole input contract)."""
    out = root / name
    out.mkdir()
    metrics = {"win_rate": win, "reward_gain": gain, "candidate_reward_mean": reward, "kl_to_baseline": kl}
    metrics["win_rate_lower_bound"] = win - 0.1  # as if from a few dozen prompts
    metrics.update(GUARD_FIGURES)
    (out / "result.json").write_text(json.dumps({"stage": "evaluate", "metrics": metrics, "outputs": {}}))
    return out


def promote(cli, eval_dir: Path, out: Path, *extra: str):
    model = loading.resolve("tiny-opt")
    return cli("promote", "--evaluation", eval_dir, "--model-dir", model, "--output", out, *extra)


def aliases(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())["aliases"]


def test_gate_aliases_idempotency_and_rollback_on_sqlite(cli, tmp_path: Path):
    evals = tmp_path / "evals"
    evals.mkdir()
    root = tmp_path / "runs"
    first = evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0)
    assert promote(cli, first, root / "p1").code == 0
    assert aliases(root / "p1") == {"challenger": 1, "champion": 1, "previous-champion": None}
    again = promote(cli, first, root / "p2")
    assert again.code == 0 and aliases(root / "p2") == aliases(root / "p1")  # no second version
    worse = promote(cli, evaluation(evals, "worse", win=0.3, gain=0.3, reward=1.1), root / "p3")
    assert worse.code == 0 and aliases(root / "p3") == {"challenger": 2, "champion": 1, "previous-champion": None}
    below_champion = promote(cli, evaluation(evals, "below", win=0.9, gain=0.5, reward=0.9), root / "p4")
    assert aliases(root / "p4") == {"challenger": 3, "champion": 1, "previous-champion": None}
    assert "FAIL: candidate_reward_mean: needs > 1.000 (the champion's), got 0.900" in below_champion.out
    better = promote(cli, evaluation(evals, "better", win=0.8, gain=0.4, reward=1.2), root / "p5")
    assert better.code == 0 and aliases(root / "p5") == {"challenger": 4, "champion": 4, "previous-champion": 1}

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    assert len(client.search_model_versions("name = 'kubealign-actor'")) == 4
    tags = client.get_model_version("kubealign-actor", "4").tags
    assert tags["kubealign.metric.win_rate"] == "0.8" and tags["kubealign.code_version"]

    os.environ["MLFLOW_TRACKING_URI"] = uri
    try:
        rolled = cli("rollback")
        assert rolled.code == 0 and "champion is version 1 again (was 4)" in rolled.out
        assert str(client.get_model_version_by_alias("kubealign-actor", "champion").version) == "1"
        nothing = cli("rollback")
        assert nothing.code == 2 and "no previous-champion alias" in nothing.err
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def test_in_canary_mode_a_passing_candidate_becomes_challenger_only(cli, tmp_path: Path):
    """promote.mode=canary: the first version (no champion to be judged against) becomes champion; later, a
    candidate that passes the gate becomes challenger beside the champion, one that fails moves no alias."""
    evals, root, canary = tmp_path / "evals", tmp_path / "runs", ("--set", "promote.mode=canary")
    evals.mkdir()
    first = promote(cli, evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0), root / "p1", *canary)
    assert first.code == 0 and aliases(root / "p1") == {"challenger": None, "champion": 1, "previous-champion": None}
    worse = promote(cli, evaluation(evals, "worse", win=0.3, gain=0.3, reward=1.1), root / "p2", *canary)
    assert worse.code == 0 and aliases(root / "p2") == {"challenger": None, "champion": 1, "previous-champion": None}
    better = promote(cli, evaluation(evals, "better", win=0.8, gain=0.4, reward=1.2), root / "p3", *canary)
    assert better.code == 0 and aliases(root / "p3") == {"challenger": 3, "champion": 1, "previous-champion": None}
    assert json.loads((root / "p3" / "result.json").read_text())["mode"] == "canary"
    # the same candidate in direct mode, as before: champion, the old one kept
    direct = promote(cli, evaluation(evals, "direct", win=0.8, gain=0.4, reward=1.3), root / "p4")
    assert direct.code == 0 and aliases(root / "p4") == {"challenger": 4, "champion": 4, "previous-champion": 1}


def test_the_alias_plan_of_each_mode() -> None:
    from kubealign.promotion.aliases import promotion_plan as alias_plan

    assert alias_plan("direct", True, True, "3", "1") == [
        ("challenger", "3"),
        ("previous-champion", "1"),
        ("champion", "3"),
    ]
    assert alias_plan("direct", True, False, "3", "1") == [("challenger", "3")]
    assert alias_plan("direct", True, True, "1", "1") == [("challenger", "1")]  # already champion
    assert alias_plan("direct", True, True, "1", None) == [("challenger", "1"), ("champion", "1")]
    assert alias_plan("canary", True, True, "3", "1") == [("challenger", "3")]
    assert alias_plan("canary", True, False, "3", "1") == []
    assert alias_plan("canary", True, True, "1", "1") == []
    assert alias_plan("canary", True, True, "1", None) == [("champion", "1")]
    assert alias_plan("canary", True, False, "1", None) == []
    assert alias_plan("direct", False, True, "3", "1") == alias_plan("canary", False, True, "3", "1") == []


def test_a_hacked_candidate_is_registered_but_refused_in_one_line(cli, tmp_path: Path):
    """The reward model's figures say promote; the held-out log-likelihood and distinct-2 say it broke: the
    version is registered, no alias moves to it, the one refusal line says why. Without its figures a guard
    that is on is a clean error before the registry is touched; turned off, the guard is not asked for."""
    evals, root = tmp_path / "evals", tmp_path / "runs"
    evals.mkdir()
    assert promote(cli, evaluation(evals, "honest", win=0.7, gain=0.3, reward=1.0), root / "p1").code == 0
    hacked = evaluation(evals, "hacked", win=0.95, gain=3.9, reward=2.75)
    result = json.loads((hacked / "result.json").read_text())
    result["metrics"].update(candidate_heldout_logprob=-6.8, candidate_distinct_2=0.02)
    (hacked / "result.json").write_text(json.dumps(result))
    done = promote(cli, hacked, root / "p2")
    assert done.code == 0 and aliases(root / "p2") == {"challenger": 2, "champion": 1, "previous-champion": None}
    refusal = (
        "gate refused: capability: held-out log-likelihood per token drop: needs <= 1.0, got 4.800 (baseline -2.000, candidate -6.800); "
        "degeneration: distinct-2 ratio: needs >= 0.5, got 0.033 (baseline 0.600, candidate 0.020); "
        "the training reward model's gain +3.900 is not trusted (reward hacking suspected)"
    )
    written = json.loads((root / "p2" / "result.json").read_text())
    assert refusal in done.out.splitlines() and written["refusal"] == refusal
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{root / 'mlflow.db'}").get_model_version("kubealign-actor", "2").tags
    assert tags["kubealign.metric.candidate_heldout_logprob"] == "-6.8"  # the registry shows why, too
    assert tags["kubealign.metric.heldout_win_rate"] == "0.75" and tags["kubealign.metric.reward_agreement"] == "0.8"
    del result["metrics"]["baseline_distinct_2"]
    (hacked / "result.json").write_text(json.dumps(result))
    lacking = promote(cli, hacked, root / "p3")
    assert lacking.code == 2 and not (root / "p3").exists()
    assert lacking.err.strip().splitlines()[-1] == (
        f"kubealign: error: --evaluation {hacked}: result.json lacks baseline_distinct_2, which promote.guards.min_distinct_ratio "
        "checks (evaluate writes it); evaluate again, or set promote.guards.min_distinct_ratio: null to promote "
        "without this guard"
    )
    off = promote(cli, hacked, root / "p4", "--set", "promote.guards.min_distinct_ratio=null")
    assert off.code == 0 and json.loads((root / "p4" / "result.json").read_text())["refusal"].startswith(
        "gate refused: capability: "
    )
    # an evaluation scored by a reward model with no held-out one beside it (data.heldout_reward_fraction 0)
    del result["metrics"]["heldout_win_rate"]
    (hacked / "result.json").write_text(json.dumps(result))
    unheld = promote(cli, hacked, root / "p5", "--set", "promote.guards.min_distinct_ratio=null")
    assert unheld.code == 2 and not (root / "p5").exists()
    assert unheld.err.strip().splitlines()[-1] == (
        f"kubealign: error: --evaluation {hacked}: result.json lacks heldout_win_rate, which "
        "promote.guards.min_heldout_win_rate checks (evaluate writes it when the reward model dir holds heldout/: "
        "data.heldout_reward_fraction > 0); evaluate again, or set promote.guards.min_heldout_win_rate: null to "
        "promote without this guard"
    )


def test_not_an_evaluation_is_a_clean_error(cli, tmp_path: Path):
    bogus = tmp_path / "sft"
    bogus.mkdir()
    (bogus / "result.json").write_text(json.dumps({"stage": "sft", "metrics": {}, "outputs": {}}))
    result = promote(cli, bogus, tmp_path / "out")
    assert result.code == 2 and "is from stage 'sft', not evaluate" in result.err and not (tmp_path / "out").exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """A real `mlflow server` on 127.0.0.1 for this test, stopped afterwards."""
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'server.db'}",
        "--artifacts-destination",
        (tmp_path / "server-artifacts").as_uri(),
        "--workers",
        "1",
    ]
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "server.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_promotion_through_an_mlflow_server_and_the_champion_generates(cli, tmp_path: Path, mlflow_server: str):
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server
    try:
        evals = tmp_path / "evals"
        evals.mkdir()
        result = promote(cli, evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0), tmp_path / "out")
        assert result.code == 0, result.err
        assert aliases(tmp_path / "out")["champion"] == 1
        import mlflow

        model = mlflow.pyfunc.load_model("models:/kubealign-actor@champion")  # resolved via MLFLOW_TRACKING_URI
        replies = model.predict(["\n\nHuman: Tell me about cats.\n\nAssistant:"], params={"max_new_tokens": 4})
        assert len(replies) == 1 and isinstance(replies[0], str)
        # what the registry serves holds no pickle (a swapped one would run code in every consumer) ...
        tree = Path(mlflow.artifacts.download_artifacts("models:/kubealign-actor/1", dst_path=str(tmp_path / "dl")))
        files = [p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()]
        assert "MLmodel" in files and any(f.endswith(".safetensors") for f in files), files
        assert not [f for f in files if f.endswith((".pkl", ".pickle")) or "cloudpickle" in f], files
        flavor = yaml.safe_load((tree / "MLmodel").read_text())["flavors"]["python_function"]
        assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model" and "python_model" not in flavor
        # ... and pins its requirements
        requirements = (tree / "requirements.txt").read_text().split()
        assert f"kubealign=={__version__}" in requirements, requirements
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def test_a_failed_alias_move_puts_the_aliases_back(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    evals = tmp_path / "evals"
    evals.mkdir()
    root = tmp_path / "runs"
    assert (
        promote(cli, evaluation(evals, "first", win=0.3, gain=0.0, reward=1.0), root / "p1").code == 0
    )  # challenger=1
    real = MlflowClient.set_registered_model_alias

    def failing(self, name, alias, version):
        if alias == "champion":
            raise MlflowException("permission denied: cannot set alias champion")
        return real(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", failing)
    result = promote(cli, evaluation(evals, "second", win=0.9, gain=0.5, reward=1.5), root / "p2")
    last = result.err.strip().splitlines()[-1]  # MLflow's own warnings about logging the model come first
    assert result.code == 2 and last.startswith("kubealign: error: MLflow registry at") and "permission denied" in last
    monkeypatch.undo()
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert str(client.get_model_version_by_alias("kubealign-actor", "challenger").version) == "1"  # restored
    assert not (root / "p2").exists()


def test_registry_server_down_is_a_clean_error(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    evals = tmp_path / "evals"
    evals.mkdir()
    result = promote(cli, evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0), tmp_path / "out")
    assert result.code == 2 and "http://127.0.0.1:9" in result.err and len(result.err.strip().splitlines()) == 1


def test_the_registry_lease_waits_for_a_live_holder_and_breaks_a_dead_ones(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import socket

    from mlflow.tracking import MlflowClient

    from kubealign.promotion import aliases as stage_aliases
    from kubealign.promotion import lease as stage

    evals, root = tmp_path / "evals", tmp_path / "runs"
    evals.mkdir()
    assert promote(cli, evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0), root / "p1").code == 0
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    lock = "kubealign-actor" + stage.LEASE_SUFFIX
    host, later = socket.gethostname(), str(time.time() + 200)  # within the TTL, as a promote sets it
    client.create_registered_model(lock, tags={"owner": f"{host}:{os.getpid()}:live", "expires": later})
    monkeypatch.setattr(stage, "LEASE_WAIT_S", 2)
    better = evaluation(evals, "better", win=0.8, gain=0.4, reward=1.2)
    held = promote(cli, better, root / "p2")
    assert held.code == 2 and "has held its lease" in held.err and not (root / "p2").exists()
    assert len(client.search_model_versions("name = 'kubealign-actor'")) == 1  # nothing registered meanwhile

    client.delete_registered_model(lock)  # a holder on this host whose process is gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    client.create_registered_model(lock, tags={"owner": f"{host}:{gone.pid}:dead", "expires": later})
    assert promote(cli, better, root / "p2").code == 0 and aliases(root / "p2")["champion"] == 2
    assert not client.search_registered_models(f"name = '{lock}'")

    # a lease no promote wrote (expiring further ahead than any promote sets, or not owned host:pid:nonce) is
    # refused at once, in one line naming it, not waited for
    for tags in ({"owner": f"{host}:1:x", "expires": str(time.time() + 3600)}, {"owner": "me", "expires": later}):
        client.create_registered_model(lock, tags=tags)
        started = time.monotonic()
        squatted = promote(cli, better, root / "p9")
        assert squatted.code == 2 and time.monotonic() - started < 30, squatted.err
        assert f"its lease {lock} was not written by a kubealign promote" in squatted.err
        assert len(squatted.err.strip().splitlines()) == 1
        client.delete_registered_model(lock)

    # an expired lease from another host, and a journal whose moves all landed (only clearing it failed)
    client.create_registered_model(lock, tags={"owner": "elsewhere:1:x", "expires": str(time.time() - 1)})
    journal = {"before": {"champion": "1"}, "plan": [["champion", "2"]], "time": 0}
    client.set_registered_model_tag("kubealign-actor", stage_aliases.JOURNAL_TAG, json.dumps(journal))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    rolled = cli("rollback")
    assert rolled.code == 0 and "champion is version 1 again (was 2)" in rolled.out, rolled.err
    assert "put back" not in rolled.err  # a completed move is not undone
    assert stage_aliases.JOURNAL_TAG not in client.get_registered_model("kubealign-actor").tags
    assert not client.search_registered_models(f"name = '{lock}'")


def test_rollback_refuses_credentials_in_the_uri(cli, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cret@mlflow.example.com")
    result = cli("rollback")
    assert result.code == 2 and "MLFLOW_TRACKING_USERNAME" in result.err
    assert "s3cret" not in result.err


@pytest.mark.unit
def test_versions_registered_before_the_move_still_find_their_class() -> None:
    """A version logged by an earlier release carries a code file that imports kubealign.registry.ActorModel."""
    import kubealign.registry as old_path
    from kubealign.promotion import registry

    assert old_path.ActorModel is registry.ActorModel and old_path.INPUT_EXAMPLE is registry.INPUT_EXAMPLE
    assert "from kubealign.promotion.registry import ActorModel" in registry.MODEL_CODE  # new versions: new path


def test_every_version_carries_its_manifest_and_one_without_is_refused(cli, tmp_path: Path):
    """promote registers provenance.json among the version's artifacts (the digest of every file it uploaded,
    the recipe) with its key fields as tags; a version registered without one (by an older release: the same
    promotion key, no manifest) passes no gate: registered, no alias moves, one line says why."""
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.versions import KEY_TAG, promotion_key
    from kubealign.provenance.digests import file_digests
    from kubealign.provenance.manifest import read

    evals, root = tmp_path / "evals", tmp_path / "runs"
    evals.mkdir()
    first = evaluation(evals, "good", win=0.7, gain=0.3, reward=1.0)
    done = promote(cli, first, root / "p1")
    assert done.code == 0 and "pass: provenance: provenance.json recorded, model sha256 " in done.out
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    version = client.get_model_version("kubealign-actor", "1")
    recorded = read(version.source, f"sqlite:///{root / 'mlflow.db'}")
    model = Path(loading.resolve("tiny-opt"))
    assert recorded["files"] == file_digests(model) and "model.safetensors" in recorded["files"]
    assert version.tags["kubealign.provenance.model_sha256"] == recorded["model_sha256"]
    assert (
        recorded["evaluation"]["win_rate"] == 0.7
        and recorded["config"]["promote"]["registered_model"] == "kubealign-actor"
    )
    assert json.loads((root / "p1" / "result.json").read_text())["model_sha256"] == recorded["model_sha256"]

    older = evaluation(evals, "older", win=0.8, gain=0.4, reward=1.2)
    client.create_model_version("kubealign-actor", source=str(model), tags={KEY_TAG: promotion_key(older, model)})
    refused = promote(cli, older, root / "p2")
    assert refused.code == 0 and aliases(root / "p2") == {"challenger": 2, "champion": 1, "previous-champion": None}
    line = "gate refused: provenance: version 2 has no provenance.json among its artifacts (registered without one)"
    assert json.loads((root / "p2" / "result.json").read_text())["refusal"] == line
