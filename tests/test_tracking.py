"""Tracking against a real MLflow sqlite store: params, metrics, artifacts, nesting, attach, ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubealign.config import load_config
from kubealign.errors import UserError
from kubealign.stages import data_split
from kubealign.tracking import PARENT_RUN_ENV, default_store

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
    src = tmp_path / "bad.jsonl"
    src.write_text("{nope\n")
    config = load_config(None, [f"data.sources=[{{path: {src}}}]"])
    with pytest.raises(UserError):
        data_split.run(config, tmp_path / "out")
    client = client_for(tmp_path)
    (run,) = client.search_runs([client.get_experiment_by_name("kubealign-tiny").experiment_id])
    assert run.info.status == "FAILED"


def test_only_rank_zero_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RANK", "1")
    result = data_split.run(load_config(None, SMALL), tmp_path / "out")
    assert result["run_id"] is None
    assert not (tmp_path / "mlflow.db").exists()


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
