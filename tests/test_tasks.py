"""kubealign.tasks: what the KFP components hand to KFP (metrics, ROC, report) and how they launch."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from kubealign import tasks
from kubealign.config import config_from_json, config_to_json, load_config
from kubealign.errors import UserError


def test_roc_and_pairwise_confusion_matrix(tmp_path: Path) -> None:
    # 3 pairs: chosen scores first, then the rejected ones; pairs 0 and 2 ranked right, pair 1 wrong
    scores = {
        "labels": [1, 1, 1, 0, 0, 0],
        "scores": [2.0, -1.0, 0.5, 1.0, 0.0, -2.0],
        "fpr": [0.0, 0.0, 1.0],
        "tpr": [0.0, 0.5, 1.0],
        "thresholds": [None, 2.0, -2.0],
    }
    (tmp_path / "eval_scores.json").write_text(json.dumps(scores), encoding="utf-8")
    fpr, tpr, thresholds, matrix = tasks.roc(str(tmp_path))
    assert matrix == [[2, 1], [1, 2]]  # rows: true rejected, true chosen; columns: predicted
    assert thresholds == [3.0, 2.0, -2.0]  # sklearn's +inf becomes max score + 1
    assert (fpr, tpr) == (scores["fpr"], scores["tpr"])


class FakeArtifact:
    def __init__(self, path: Path):
        self.path, self.metadata, self.logged = str(path), {}, {}

    def log_metric(self, key: str, value: float) -> None:
        self.logged[key] = value
        self.metadata[key] = value


def test_to_kfp_logs_numbers_and_writes_the_metrics_file(tmp_path: Path) -> None:
    metrics, model = FakeArtifact(tmp_path / "metrics"), FakeArtifact(tmp_path / "model")
    tasks.to_kfp({"stage": "sft", "metrics": {"loss": 1.5, "steps": 3, "note": "x"}}, metrics, model)
    assert metrics.logged == {"loss": 1.5, "steps": 3.0}
    assert model.metadata == {"stage": "sft", "loss": 1.5, "steps": 3.0}
    assert json.loads((tmp_path / "metrics").read_text(encoding="utf-8")) == {"loss": 1.5, "steps": 3.0}


def test_held_aliases() -> None:
    result = {"version": 3, "aliases": {"challenger": 3, "champion": 3, "previous-champion": 2}}
    assert tasks.held_aliases(result) == "challenger,champion"
    assert tasks.held_aliases({"version": 4, "aliases": {"challenger": 4, "champion": 3}}) == "challenger"


def test_report_inlines_the_plots(tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\nfake"
    (tmp_path / "samples.html").write_text("<html><body><table></table></body></html>", encoding="utf-8")
    (tmp_path / "samples.md").write_text("| a |\n", encoding="utf-8")
    (tmp_path / "reward_distribution.png").write_bytes(png)
    tasks.write_report(str(tmp_path), str(tmp_path / "out" / "report.html"), str(tmp_path / "s.md"))
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in page
    assert page.index("<table>") < page.index("<img") < page.index("</body>")
    assert (tmp_path / "s.md").read_text(encoding="utf-8") == "| a |\n"


def test_torchrun_commands() -> None:
    single = tasks.torchrun_command(4, ["sft", "--data", "d"])
    assert single == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                      "-m", "kubealign.cli", "sft", "--data", "d"]  # fmt: skip
    node = tasks.torchrun_command(0, ["ppo"], nnodes_from_env=True)
    assert node == [sys.executable, "-m", "torch.distributed.run", "-m", "kubealign.cli", "ppo"]


def test_config_json_round_trip_and_errors() -> None:
    config = load_config("opt-13b-8gpu")
    assert config_from_json(config_to_json(config)) == config
    assert config_from_json(config_to_json(config), ["ppo.num_iterations=3"]).ppo.num_iterations == 3
    with pytest.raises(UserError, match="config_json: invalid JSON at line 1"):
        config_from_json("{nope")
    with pytest.raises(UserError, match="config_json: field 'ppo.kl_coef'"):
        config_from_json(json.dumps({"ppo": {"kl_coef": -1}}))
    with pytest.raises(UserError, match="unknown training stage 'ppo'"):
        tasks.train("ppo", config_to_json(config), [], "d", "", "o")


@pytest.mark.integration
def test_a_multi_gpu_pod_runs_the_stage_under_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a task does on a pod with 2 GPUs, on 2 CPU ranks: the stage under torchrun with the task's
    config, the result read back. The caller's own rendezvous settings (a busy port) must not leak in."""
    import socket

    config_json = config_to_json(load_config(None, ["tracking.enabled=false", "reward.num_train_epochs=0.3"]))
    split = tmp_path / "split"
    tasks.data_split(config_json, [], str(split))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setattr(tasks, "device_count", lambda: 2)
        result = tasks.train("reward", config_json, ["reward.seed=7"], str(split), "", str(tmp_path / "rm"))
    assert result["stage"] == "reward"
    hashes = result["rank_param_sha256"]
    assert len(hashes) == 2 and len(set(hashes)) == 1  # two ranks, one model
    assert (tmp_path / "rm" / "model.safetensors").is_file()
