"""kubealign.tasks: what the KFP components hand to KFP (metrics, ROC, report: tasks.artifacts) and how they
launch (tasks.launch)."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

import pytest

from kubealign import pod, tasks
from kubealign.config import config_from_json, config_to_json, load_config
from kubealign.errors import UserError
from kubealign.tasks import artifacts, launch


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
    fpr, tpr, thresholds, matrix = artifacts.roc(str(tmp_path))
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
    artifacts.to_kfp({"stage": "sft", "metrics": {"loss": 1.5, "steps": 3, "note": "x"}}, metrics, model)
    assert metrics.logged == {"loss": 1.5, "steps": 3.0}
    assert model.metadata == {"stage": "sft", "loss": 1.5, "steps": 3.0}
    assert json.loads((tmp_path / "metrics").read_text(encoding="utf-8")) == {"loss": 1.5, "steps": 3.0}
    # a pull with nothing decided yet has no win-rate (NaN): protobuf JSON has no NaN, so KFP gets it not at all
    nan = {"stage": "feedback", "metrics": {"decided": 0, "human_win_rate": float("nan"), "gain": float("inf")}}
    metrics, rows = FakeArtifact(tmp_path / "m2"), FakeArtifact(tmp_path / "rows")
    artifacts.to_kfp(nan, metrics, rows)
    assert metrics.logged == {"decided": 0.0} and rows.metadata == {"stage": "feedback", "decided": 0.0}


def test_held_aliases() -> None:
    result = {"version": 3, "aliases": {"challenger": 3, "champion": 3, "previous-champion": 2}}
    assert artifacts.held_aliases(result) == "challenger,champion"
    assert artifacts.held_aliases({"version": 4, "aliases": {"challenger": 4, "champion": 3}}) == "challenger"


def test_report_inlines_the_plots(tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\nfake"
    (tmp_path / "samples.html").write_text("<html><body><table></table></body></html>", encoding="utf-8")
    (tmp_path / "samples.md").write_text("| a |\n", encoding="utf-8")
    (tmp_path / "reward_distribution.png").write_bytes(png)
    artifacts.write_report(str(tmp_path), str(tmp_path / "out" / "report.html"), str(tmp_path / "s.md"))
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in page
    assert page.index("<table>") < page.index("<img") < page.index("</body>")
    assert (tmp_path / "s.md").read_text(encoding="utf-8") == "| a |\n"


def test_torchrun_commands() -> None:
    single = launch.torchrun_command(4, ["sft", "--data", "d"])
    assert single == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "-m",
        "kubealign.cli",
        "sft",
        "--data",
        "d",
    ]
    node = launch.torchrun_command(0, ["ppo"], nnodes_from_env=True)
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
@pytest.mark.multinode  # several ranks launched by torchrun: the multinode tier (make test-multinode), outside make test
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
        monkeypatch.setattr(launch, "device_count", lambda: 2)  # what tasks.train reads
        result = tasks.train("reward", config_json, ["reward.seed=7"], str(split), "", str(tmp_path / "rm"))
    assert result["stage"] == "reward"
    hashes = result["rank_param_sha256"]
    assert len(hashes) == 2 and len(set(hashes)) == 1  # two ranks, one model
    assert (tmp_path / "rm" / "model.safetensors").is_file()


# --- preemption on the cluster: where a task keeps its checkpoints, and a retried task ------------------------

POD = {"KUBEALIGN_CHECKPOINT_ROOT": "", "KUBEALIGN_RUN_ID": "0f3c-run", "KUBEALIGN_TASK": "ppo"}


@pytest.mark.unit
def test_checkpoints_live_under_the_run_and_task_and_a_retry_resumes(tmp_path: Path) -> None:
    env = {**POD, "KUBEALIGN_CHECKPOINT_ROOT": str(tmp_path)}
    location, resume = launch.checkpoint_location(env)
    assert (location, resume) == (tmp_path / "0f3c-run" / "ppo", False)  # the first try: nothing there yet
    (location / "iter2").mkdir(parents=True)
    assert launch.checkpoint_location(env) == (location, True)  # a retry of the same task in the same run
    assert launch.checkpoint_location({**env, "KUBEALIGN_TASK": "grpo"}) == (tmp_path / "0f3c-run" / "grpo", False)
    # kfp.local, a pipeline without a PVC, a backend that does not label its pods: beside the output
    for missing in POD:
        assert launch.checkpoint_location({**env, missing: ""}) == (None, False)
    with pytest.raises(UserError, match="KUBEALIGN_RUN_ID='..' is not a directory name"):
        launch.checkpoint_location({**env, "KUBEALIGN_RUN_ID": ".."})
    assert launch.checkpoint_args(location, True) == ["--checkpoints", str(location), "--resume"]
    assert launch.checkpoint_args(None, False) == []


@pytest.mark.integration
def test_a_retried_sft_task_resumes_from_the_pvc_after_a_sigkill(tmp_path: Path) -> None:
    """The cluster's path, on this machine: the sft task killed (SIGKILL, no handler runs) after its step-4
    checkpoint, then the same task in a new pod (a fresh output directory, the same run and task) resumes
    from the PVC and ends with the weights of a task that was never interrupted; the PVC is left tidy."""
    import subprocess

    from tests.stages.test_training import result_of

    config_json = config_to_json(
        load_config(None, ["tracking.enabled=false", "sft.num_train_epochs=0.3", "sft.save_every_steps=4"])
    )
    split = tmp_path / "split"
    tasks.data_split(config_json, [], str(split))
    (tmp_path / "config.json").write_text(config_json, encoding="utf-8")
    script = "import sys; from kubealign import tasks; tasks.train('sft', open(sys.argv[1]).read(), [], *sys.argv[2:])"
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"}}
    pvc = tmp_path / "pvc" / "checkpoints"
    pod = {**env, **POD, "KUBEALIGN_CHECKPOINT_ROOT": str(pvc), "KUBEALIGN_TASK": "sft", "TQDM_DISABLE": "1"}

    def task(output: str, extra: dict) -> subprocess.CompletedProcess:
        args = [sys.executable, "-c", script, str(tmp_path / "config.json"), str(split), "", str(tmp_path / output)]
        return subprocess.run(args, capture_output=True, text=True, env={**pod, **extra}, timeout=300)

    straight = task("straight", {"KUBEALIGN_CHECKPOINT_ROOT": ""})
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = task("try1", {"KUBEALIGN_FAULT_AT_STEP": "6"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    saved = pvc / "0f3c-run" / "sft"
    assert (saved / "latest").read_text() == "step4" and not (tmp_path / "try1").exists()
    retried = task("try2", {})
    assert retried.returncode == 0, retried.stderr[-2000:]
    assert f"checkpoints: {saved} (resuming from them)" in retried.stdout
    a, b = result_of(tmp_path / "straight"), result_of(tmp_path / "try2")
    assert a["history"][4:] == b["history"] and a["rank_param_sha256"] == b["rank_param_sha256"]
    assert list(pvc.iterdir()) == []  # the task's checkpoints and the run's directory are gone


@pytest.mark.unit
def test_a_multi_node_ppo_task_names_its_trainjob_after_the_run_and_removes_its_staging(tmp_path, monkeypatch):
    """With a fake cluster: the TrainJob is named after the run and task (a retry replaces the same one), the
    nodes get --checkpoints/--resume on the PVC, the task pod owns it, and the staging directory on the PVC
    is gone after success and after a failure alike."""
    from kubealign.cluster import trainjob
    from tests.cluster.test_trainjob import Cluster, cond

    config = load_config(
        None,
        [
            "kubernetes.ppo_nodes=2",
            "kubernetes.ppo_gpus=1",
            f"kubernetes.pvc_mount={tmp_path / 'pvc'}",
            "kubernetes.pvc=shared",
            "kubernetes.namespace=team-a",
        ],
    )
    inputs = {}
    for label in ("prompts", "actor", "critic"):
        inputs[label] = tmp_path / label
        inputs[label].mkdir()
    monkeypatch.setenv("KUBEALIGN_RUN_ID", "run-7")
    monkeypatch.setenv("KUBEALIGN_TASK", "ppo")
    for key, value in (("NAME", "pod-a"), ("UID", "u-1"), ("NAMESPACE", "team-a")):
        monkeypatch.setenv(f"KUBEALIGN_POD_{key}", value)
    location = tmp_path / "pvc" / "checkpoints" / "run-7" / "ppo"
    name = "kubealign-ppo-" + __import__("hashlib").sha256(b"run-7/ppo").hexdigest()[:10]
    created = []

    class Runs(Cluster):
        def create_namespaced_custom_object(self, group, version, namespace, plural, body):
            super().create_namespaced_custom_object(group, version, namespace, plural, body)
            created.append(body)
            out = tmp_path / "pvc" / "trainjobs" / name / "output"  # what the nodes write
            out.mkdir(parents=True)
            (out / "result.json").write_text(json.dumps({"stage": "ppo"}))

    cluster = Runs(existing={name: {}}, statuses=[cond("Complete")])  # an earlier try's TrainJob
    monkeypatch.setattr(trainjob, "connect", lambda: (cluster, None))
    stale = tmp_path / "pvc" / "trainjobs" / name / "stale-file"
    stale.parent.mkdir(parents=True)
    stale.write_text("left by the SIGKILLed try")
    paths = [str(inputs[k]) for k in ("prompts", "actor", "critic")]
    result = launch.ppo_trainjob(config, *paths, str(tmp_path / "out"), [], location, True)
    assert result == {"stage": "ppo"} and (tmp_path / "out" / "result.json").is_file()
    assert cluster.log == [("delete", name), ("create", name)]
    body = created[0]
    assert body["metadata"]["name"] == name and body["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    command = body["spec"]["trainer"]["command"]
    assert command[-3:] == ["--checkpoints", str(location), "--resume"]
    assert not (tmp_path / "pvc" / "trainjobs" / name).exists()
    cluster = Runs(statuses=[cond("Failed", message="node-1 exited 1")])
    monkeypatch.setattr(trainjob, "connect", lambda: (cluster, None))
    with pytest.raises(trainjob.TrainJobFailed, match="node-1 exited 1"):
        launch.ppo_trainjob(config, *paths, str(tmp_path / "out2"), [], location, False)
    # a first try's nodes resume too: a JobSet restart after a lost node reruns this very command (issue 81)
    assert not (tmp_path / "pvc" / "trainjobs" / name).exists()
    assert created[1]["spec"]["trainer"]["command"][-3:] == ["--checkpoints", str(location), "--resume"]


# --- what a run cannot edit: pinned at compile time --------------------------------------------------------


@pytest.mark.unit
def test_an_edited_reward_functions_parameter_is_refused_at_the_task(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    from kubealign.usercode import definitions

    (tmp_path / "f.py").write_text("def f(prompts, completions):\n    return [1.0] * len(completions)\n")
    (tmp_path / "c.yaml").write_text("rewards: {functions: [{path: f.py:f}]}\n", encoding="utf-8")
    config = load_config(str(tmp_path / "c.yaml"), [])
    compiled = definitions.to_json(definitions.resolve(config.rewards, config.base_dir))
    pins = tasks.pins(config, compiled)
    assert pins == {pod.FUNCTIONS_SHA_ENV: hashlib.sha256(compiled.encode()).hexdigest(), pod.REMOTE_CODE_ENV: ""}
    for key, value in pins.items():
        monkeypatch.setenv(key, value)
    assert [s.name for s in tasks.reward_functions(config, compiled)] == ["f"]
    edited = compiled.replace("[1.0]", "[9.0]")  # what a run's parameter could carry
    with pytest.raises(UserError, match=r"^reward_functions: sha256 \w+… is not the \w+… compiled into the pipeline"):
        tasks.reward_functions(config, edited)
    monkeypatch.delenv(pod.FUNCTIONS_SHA_ENV)  # kubealign rerun / a stage by hand: nothing pinned
    assert len(tasks.reward_functions(config, edited)) == 1


@pytest.mark.unit
def test_trust_remote_code_only_where_the_pipeline_was_compiled_with_it(monkeypatch) -> None:
    trusting = config_to_json(load_config(None, ["sft.trust_remote_code=true"]))
    monkeypatch.setenv(pod.REMOTE_CODE_ENV, "")  # compiled without it
    with pytest.raises(UserError, match=r"^sft.trust_remote_code is true in this run's config_json but the pipeline"):
        tasks.load(trusting)
    assert tasks.load(config_to_json(load_config(None, [])))  # nothing asked: fine
    monkeypatch.setenv(pod.REMOTE_CODE_ENV, "sft")  # compiled with it
    assert tasks.load(trusting).sft.trust_remote_code
    monkeypatch.setenv(pod.REMOTE_CODE_ENV, "reward")
    with pytest.raises(UserError, match="sft.trust_remote_code"):
        tasks.load(trusting)
    monkeypatch.delenv(pod.REMOTE_CODE_ENV)
    assert tasks.load(trusting).sft.trust_remote_code  # not a compiled pipeline's task
    assert (
        tasks.pins(load_config(None, ["dpo.trust_remote_code=true", "sft.trust_remote_code=true"]), "[]")[
            pod.REMOTE_CODE_ENV
        ]
        == "sft,dpo"
    )


# --- the act task: the judge's verdict file -----------------------------------------------------------------

CANARY = ["serve.enabled=true", "promote.mode=canary"]
VERDICT = {
    "judged": True,
    "promoted": True,
    "version": "3",
    "registered_model": "kubealign-actor",
    "inference_service": "team-a/kubealign-actor",
    "verdict": "judge: challenger (version 3) holds online",
}


def judgement(tmp_path: Path, text: str) -> Path:
    """A judge task's output whose verdict.json holds `text`."""
    from kubealign.stages.judge_task import VERDICT_FILE

    out = tmp_path / "judge"
    out.mkdir()
    (out / "result.json").write_text(json.dumps({"stage": "judge", "metrics": {}}), encoding="utf-8")
    (out / VERDICT_FILE).write_text(text, encoding="utf-8")
    return out


@pytest.mark.unit
def test_rerun_act_refuses_a_malformed_verdict_in_one_line(cli, tmp_path: Path) -> None:
    """`kubealign rerun act` on a judge output whose verdict.json is cut short: exit 2, one line naming the file,
    no output written and nothing asked of a registry (none is configured: the refusal comes first)."""
    from kubealign.outputs import tree_sha256

    judged = judgement(tmp_path, json.dumps(VERDICT)[:40])
    run = tmp_path / "run"
    run.mkdir()
    stages = {"judge": {"dir": str(judged), "sha256": tree_sha256(judged)}}
    index = {"config_json": config_to_json(load_config(None, CANARY)), "stages": stages}
    (run / "run.json").write_text(json.dumps(index), encoding="utf-8")
    done = cli("rerun", "act", "--from", run, "--output", tmp_path / "again")
    assert done.code == 2 and "Traceback" not in done.err  # (MLflow's own INFO lines above it: the rerun's store)
    assert [line for line in done.err.splitlines() if line.startswith("kubealign")] == [
        f"kubealign: error: {judged / 'verdict.json'}:1: not a verdict: invalid JSON: Unterminated string starting at"
    ]
    assert not (tmp_path / "again" / "act").exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ([], "a JSON list, not an object"),
        ({**VERDICT, "judged": "yes"}, "\"judged\" is 'yes', not true or false"),
        ({k: v for k, v in VERDICT.items() if k != "promoted"}, '"promoted" is None, not true or false'),
        ({**VERDICT, "version": "?"}, "\"version\" is '?', not a registered version number"),
        ({**VERDICT, "version": 3}, '"version" is 3, not a registered version number'),
        (
            {**VERDICT, "registered_model": "other"},
            "\"registered_model\" is 'other', not promote.registered_model 'kubealign-actor'",
        ),
        ({**VERDICT, "inference_service": "team-a"}, "\"inference_service\" is 'team-a', not NAMESPACE/NAME"),
    ],
)
def test_the_act_task_refuses_what_is_not_a_whole_verdict(tmp_path: Path, edit, said: str) -> None:
    from kubealign.stages import act

    judged = judgement(tmp_path, json.dumps(edit))
    with pytest.raises(UserError) as refused:
        act.run(load_config(None, CANARY), judged, tmp_path / "act")
    assert str(refused.value) == f"{judged / 'verdict.json'}: not a verdict: {said}"
    assert not (tmp_path / "act").exists()


@pytest.mark.unit
def test_the_act_task_carries_nothing_out_without_a_verdict_or_with_canary_act_off(tmp_path: Path) -> None:
    """Nothing judged, or a run whose config_json says canary.act false: said, written, no registry needed. No
    verdict file at all (a judge stopped before writing it): one line naming it."""
    from kubealign.stages import act

    config = load_config(None, CANARY)
    nothing = judgement(tmp_path, json.dumps({"judged": False, "why": "serve applied no canary: nothing to judge"}))
    done = act.run(config, nothing, tmp_path / "a1")
    assert done["why"] == "nothing to carry out: serve applied no canary: nothing to judge" and not done["acted"]
    assert json.loads((tmp_path / "a1" / "result.json").read_text())["stage"] == "act"
    (nothing / "verdict.json").write_text(json.dumps(VERDICT))
    off = act.run(load_config(None, [*CANARY, "canary.act=false"]), nothing, tmp_path / "a2")
    assert off["why"] == "canary.act is false: the verdict is reported, not carried out"
    (nothing / "verdict.json").unlink()
    with pytest.raises(UserError, match=f"^{nothing / 'verdict.json'}: no such file: the judge task writes it last"):
        act.run(config, nothing, tmp_path / "a3")
