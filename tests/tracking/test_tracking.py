"""Tracking against a real MLflow sqlite store: params, metrics, artifacts, nesting, attach, ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubealign.config import load_config
from kubealign.errors import UserError
from kubealign.stages import data_split
from kubealign.tracking.runs import PARENT_RUN_ENV, default_store

pytestmark = pytest.mark.integration
SMALL = ["data.synthetic_pairs=60", "data.synthetic_sft_rows=10"]


def client_for(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=default_store(root)[0])


def test_default_store_records_params_metrics_and_artifacts(cli, tmp_path: Path):
    result = cli("data-split", "--set", SMALL[0], "--set", SMALL[1], "--output", tmp_path / "split")
    assert result.code == 0, result.err
    assert (tmp_path / "mlflow.db").exists()
    client = client_for(tmp_path)
    experiment = client.get_experiment_by_name("kubealign-tiny")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "data-split"
    assert run.data.params["data.synthetic_pairs"] == "60"
    assert run.data.params["ppo.kl_coef"] == "0.1"
    res = json.loads((tmp_path / "split" / "result.json").read_text())
    assert run.data.metrics["rows_kept"] == res["metrics"]["rows_kept"] == 70
    assert run.data.tags["kubealign.cache_hit"] == "false"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "data-split"} <= artifacts
    resolved = Path(client.download_artifacts(run.info.run_id, "config/resolved.yaml", str(tmp_path / "dl")))
    assert "synthetic_pairs: 60" in resolved.read_text()
    manifest = client.download_artifacts(run.info.run_id, "data-split/manifest.json", str(tmp_path / "dl"))
    assert json.loads(Path(manifest).read_text())["cache_key"] == res.get(
        "cache_key", json.loads((tmp_path / "split" / "manifest.json").read_text())["cache_key"]
    )
    assert (tmp_path / "mlartifacts").is_dir()  # artifacts live under the output root, not the cwd


def test_nested_under_parent_and_attached_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("pipeline", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(experiment_id, run_name="pipeline-run").info.run_id
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment_id)
    monkeypatch.setenv(PARENT_RUN_ENV, parent)
    data_split.run(load_config(None, SMALL), tmp_path / "a")
    children = client.search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.run_name for r in children] == ["data-split"]
    assert children[0].info.status == "FINISHED"

    monkeypatch.delenv(PARENT_RUN_ENV)
    attached = client.create_run(experiment_id, run_name="kfp-task").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", attached)
    data_split.run(load_config(None, SMALL), tmp_path / "b")
    run = client.get_run(attached)
    assert run.data.metrics["rows_kept"] == 70
    assert run.info.status == "RUNNING"  # its owner (the KFP task) ends it, not us
    assert len(client.search_runs([experiment_id])) == 3


def test_failed_stage_marks_the_run_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """In a store that was there before (one this command made is removed again: bad input writes nothing,
    tests/cli/test_stage_quiet.py)."""
    src = tmp_path / "bad.jsonl"
    src.write_text("{nope\n")
    config = load_config(None, [f"data.sources=[{{path: {src}}}]"])
    client = client_for(tmp_path)
    client.search_experiments()  # makes the store
    with pytest.raises(UserError):
        data_split.run(config, tmp_path / "out")
    (run,) = client.search_runs([client.get_experiment_by_name("kubealign-tiny").experiment_id])
    assert run.info.status == "FAILED"


def test_only_rank_zero_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "1")
    result = data_split.run(load_config(None, SMALL), tmp_path / "out")
    assert result["run_id"] is None
    assert not (tmp_path / "mlflow.db").exists()


def test_in_a_pod_without_a_tracking_uri_the_stage_stops_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # a pod whose MLflow Secret is absent (optional: Kubernetes skips it) has no URI: a local store there would be
    # lost with the pod, so the stage says so instead of training untracked
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(
        UserError, match=r"^MLflow tracking: this pod has no MLFLOW_TRACKING_URI .* data-split's run would be lost"
    ):
        data_split.run(load_config(None, SMALL), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()
    # with a URI (the Secret's, or tracking.uri) the same pod tracks as anywhere
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'given.db'}")
    assert data_split.run(load_config(None, SMALL), tmp_path / "out")["run_id"]


def test_unreachable_tracking_server_is_a_clean_error(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A server that is down: nothing listens on port 9 (discard) of the loopback address.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    result = cli("data-split", "--output", tmp_path / "out")
    assert result.code == 2
    assert result.err.startswith("kubealign: error: MLflow tracking at http://127.0.0.1:9: ")
    assert "Connection refused" in result.err
    assert len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# --- Tracking off the training path: the background writer (a stand-in client: order, bounds, timing) ---


class StandInClient:
    """The MlflowClient calls a tracker makes, recorded; `gate` holds every call while cleared (a slow
    server), `fail` makes every call raise (a dead one)."""

    def __init__(self) -> None:
        import threading

        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def _call(self, *record) -> None:
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        self.calls.append(record)

    def log_batch(self, run_id, metrics=(), params=(), tags=()):
        self._call("batch", [(m.key, m.value, m.step, m.timestamp) for m in metrics], list(params), list(tags))

    def log_text(self, run_id, text, artifact_file):
        self._call("text", artifact_file)

    def log_artifact(self, run_id, path, artifact_path=None):
        self._call("artifact", artifact_path)

    def set_terminated(self, run_id, status):
        self._call("terminated", status)

    def metrics(self) -> list[tuple[str, float, int]]:
        return [(k, v, s) for c in self.calls if c[0] == "batch" for k, v, s, _ in c[1]]


def background(client: StandInClient, **kwargs):
    from kubealign.tracking.trackers import BackgroundTracker, MlflowTracker

    return BackgroundTracker(MlflowTracker(client, "run", "http://stand-in"), **kwargs)


def connection_refused() -> Exception:
    from mlflow.exceptions import MlflowException

    return MlflowException("API request to http://stand-in failed with exception ConnectionError: refused")


@pytest.mark.unit
def test_background_tracker_never_waits_and_sends_everything_in_order():
    import time

    client = StandInClient()
    client.gate.clear()  # a slow server: nothing gets through until the gate opens
    tracker = background(client)
    started = time.perf_counter()
    for step in range(1, 501):
        tracker.log_metrics({"train_loss": 1.0 / step, "lr": 0.1}, step=step)
    tracker.set_tags({"kubealign.model_dir": "/m"})
    tracker.log_metrics({"after": 2.0})
    logging_s = time.perf_counter() - started
    assert logging_s < 1.0  # 502 calls while the server answers nothing: none waited for it
    client.gate.set()
    assert tracker.flush(timeout=30)
    expected = [(k, v, s) for s in range(1, 501) for k, v in (("train_loss", 1.0 / s), ("lr", 0.1))]
    tags_at = next(i for i, c in enumerate(client.calls) if c[0] == "batch" and c[3])
    sent_before_tags = [m for c in client.calls[:tags_at] if c[0] == "batch" for m in c[1]]
    assert client.metrics() == [*expected, ("after", 2.0, 0)]
    assert len(sent_before_tags) == 1000  # the tags went after the metrics logged before them, not before
    assert len([c for c in client.calls if c[1]]) <= 4  # queued calls merged: ~1000 metrics per log_batch
    stamps = [t for c in client.calls if c[0] == "batch" for *_, t in c[1]]
    assert stamps == sorted(stamps)  # stamped when logged, in order
    assert [h["step"] for h in tracker.history] == [*range(1, 501), None]
    assert tracker.close() and tracker.pending == 0


@pytest.mark.unit
def test_background_queue_is_bounded_and_drops_the_oldest():
    client = StandInClient()
    client.gate.clear()
    tracker = background(client, limit=10)
    for step in range(1, 101):
        tracker.log_metrics({"x": float(step)}, step=step)
    assert tracker.pending <= 11  # 10 queued + at most 1 call in flight
    assert tracker.dropped == 100 - tracker.pending
    client.gate.set()
    assert tracker.close()
    sent = [s for _, _, s in client.metrics()]
    assert sent[-10:] == list(range(91, 101)) and len(sent) == 100 - tracker.dropped  # the newest kept
    assert len(tracker.history) == 100  # and every value still in the history


@pytest.mark.unit
def test_dead_server_warns_once_keeps_the_metrics_and_the_last_try_sends_them(capsys):
    import time

    client = StandInClient()
    client.fail = connection_refused()
    tracker = background(client, retry_s=3600)
    for step in range(1, 51):
        tracker.log_metrics({"x": float(step)}, step=step)
    deadline = time.monotonic() + 10
    while tracker.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    assert not tracker.flush(timeout=30)  # a checkpoint does not wait on a server that is down ...
    assert time.perf_counter() - started < 1.0
    tracker.log_metrics({"x": 51.0}, step=51)  # ... and logging goes on
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kubealign: warning: MLflow tracking at http://stand-in is unreachable (API request")
    assert tracker.pending == 51 and not client.calls
    client.fail = None  # back before the end: the last try sends everything, in order
    assert tracker.close()
    assert [s for _, _, s in client.metrics()] == list(range(1, 52))
    assert capsys.readouterr().err == ""  # warned once


@pytest.mark.unit
def test_a_call_the_server_refuses_is_dropped_not_retried(capsys):
    from mlflow.exceptions import MlflowException

    client = StandInClient()
    client.fail = MlflowException.invalid_parameter_value("Changing param values is not allowed")
    tracker = background(client, retry_s=0)
    tracker.log_params({"a": 1})
    assert tracker.flush(timeout=10)
    client.fail = None
    tracker.log_metrics({"x": 1.0}, step=1)
    assert tracker.close() and client.metrics() == [("x", 1.0, 1)]
    assert tracker.dropped == 1
    assert "refused a tracking call: Changing param values" in capsys.readouterr().err


def kubealign_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kubealign")]


def small_config():
    return load_config(None, SMALL)


@pytest.mark.unit
def test_ending_the_run_never_raises_over_the_stage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    from kubealign.tracking.runs import stage_run
    from kubealign.tracking.trackers import MlflowTracker

    def down(self, status):
        raise connection_refused()

    monkeypatch.setattr(MlflowTracker, "terminate", down)
    for required in (True, False):
        with pytest.raises(KeyError, match="the stage's own error"), stage_run("t", small_config(), tmp_path, required):
            raise KeyError("the stage's own error")
        (line,) = kubealign_lines(capsys.readouterr().err)  # (MLflow itself logs creating the sqlite tables)
        assert (
            line.startswith("kubealign: warning: MLflow tracking at sqlite:")
            and "could not mark the run FAILED" in line
        )
    with stage_run("t", small_config(), tmp_path, required=False) as tracker:  # a best-effort stage succeeds
        tracker.log_metrics({"x": 1.0})
    assert "could not mark the run FINISHED" in capsys.readouterr().err
    with (
        pytest.raises(UserError, match="could not mark the run FINISHED"),  # a required one fails closed
        stage_run("t", small_config(), tmp_path, required=True),
    ):
        pass


@pytest.mark.unit
def test_best_effort_stage_keeps_its_metrics_in_mlflow_when_all_is_well(tmp_path: Path):
    from kubealign.tracking.runs import stage_run
    from kubealign.tracking.trackers import BackgroundTracker

    with stage_run("t", small_config(), tmp_path, required=False) as tracker:
        assert isinstance(tracker, BackgroundTracker)
        for step in range(1, 21):
            tracker.log_metrics({"loss": 1.0 / step}, step=step)
    client = client_for(tmp_path)
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 21)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


# --- Credentials never in a tracking URI (it is copied into config_json, MLflow params and run.json) ---


@pytest.mark.unit
def test_credentials_in_a_tracking_uri_are_refused():
    from kubealign.tracking.runs import check_uri

    for fine in (
        None,
        "",
        "sqlite:///data/x.db",
        "file:///srv/m",
        "http://mlflow:5000",
        "databricks",
        "postgresql://kubealign@db/mlflow",
    ):
        check_uri(fine, "tracking.uri")
    for secret in (
        "http://alice:s3cret@mlflow:5000",
        "https://TOKEN123@mlflow.example.com",
        "postgresql://kubealign:s3cret@db/mlflow",
    ):
        with pytest.raises(UserError) as info:
            check_uri(secret, "tracking.uri")
        message = str(info.value)
        assert message.startswith("tracking.uri ") and "***@" in message
        assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in message
        assert "s3cret" not in message and "TOKEN123" not in message and "alice" not in message


@pytest.mark.unit
def test_stages_and_compile_refuse_a_tracking_uri_with_credentials(cli, tmp_path: Path, monkeypatch):
    uri = "http://alice:s3cret@127.0.0.1:9"
    result = cli("data-split", "--set", f"tracking.uri={uri}", "--output", tmp_path / "a")
    assert result.code == 2 and result.err.startswith("kubealign: error: tracking.uri http://***@127.0.0.1:9: ")
    result = cli("compile", "--set", f"tracking.uri={uri}", "--output", tmp_path / "p.yaml")
    assert result.code == 2 and "tracking.uri" in result.err and "s3cret" not in result.err + result.out
    assert not (tmp_path / "p.yaml").exists()  # the secret never reached config_json
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    result = cli("data-split", "--output", tmp_path / "b")
    assert result.code == 2 and result.err.startswith("kubealign: error: MLFLOW_TRACKING_URI http://***@")
    assert "s3cret" not in result.err and len(result.err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.unit
def test_an_experiment_created_concurrently_is_reused(tmp_path):
    """Two stages starting at once both find no experiment; the loser of the create reads the winner's."""
    from mlflow.tracking import MlflowClient

    from kubealign.tracking.runs import resolve_experiment

    client = MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    real_get = client.get_experiment_by_name
    calls = []

    def late_get(name):  # the first look happens before the other stage's create
        calls.append(name)
        return None if len(calls) == 1 else real_get(name)

    winner = client.create_experiment("race")
    client.get_experiment_by_name = late_get
    assert resolve_experiment(client, "race", None) == winner
    assert len(calls) == 2


# --- Data lineage: which data each run read (MLflow dataset inputs) ---------------------------------------------


def dataset_inputs(client: MlflowClient, run_id: str) -> list[tuple[str, str, str, dict, dict]]:
    """(name, digest, context, source, profile) of each dataset input of the run."""
    out = []
    for given in client.get_run(run_id).inputs.dataset_inputs:
        context = {t.key: t.value for t in given.tags}["mlflow.data.context"]
        d = given.dataset
        out.append((d.name, d.digest, context, json.loads(d.source), json.loads(d.profile)))
    return out


def test_data_split_and_the_stages_after_it_name_the_data_they_read(cli, tmp_path: Path):
    from kubealign.tracking.lineage import phase_ref
    from kubealign.tracking.runs import stage_run

    assert cli("data-split", "--set", SMALL[0], "--set", SMALL[1], "--output", tmp_path / "split").code == 0
    manifest = json.loads((tmp_path / "split" / "manifest.json").read_text())
    client = client_for(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("kubealign-tiny").experiment_id])
    source = manifest["sources"][0]
    assert dataset_inputs(client, run.info.run_id) == [
        (
            "synthetic",
            source["sha256"][:36],
            "source",
            {"uri": "synthetic"},
            {"rows_read": source["rows_read"], "sha256": source["sha256"], "index": 0},
        )
    ]
    # a stage names the phase it consumed: its content sha256, the split directory, its rows per split
    phase = manifest["phases"]["phase1_sft"]
    with stage_run("sft", small_config(), tmp_path, required=False) as tracker:
        tracker.log_inputs([phase_ref(tmp_path / "split", "phase1_sft", "training")])
    ((name, digest, context, where, profile),) = dataset_inputs(client, tracker.run_id)
    assert (name, digest, context) == ("phase1_sft", phase["sha256"][:36], "training")
    assert where == {"uri": str((tmp_path / "split").resolve())}
    assert (
        profile["rows"] == {k: v["rows"] for k, v in phase["splits"].items()} and profile["sha256"] == phase["sha256"]
    )
    assert phase_ref(tmp_path, "phase1_sft", "training") is None  # no manifest: nothing claimed
