"""What each Kubeflow task runs, in plain paths and strings (the library still never imports kfp).

The components in kubealign.components are declarations only: typed KFP inputs/outputs and one call
into a function here, which takes the pipeline parameter `config_json` plus overrides for the
pipeline's common knobs, runs the stage and returns its result.json. `kubealign rerun` calls the same
functions, so a stage rerun on a laptop does exactly what the task does in a pod.

Training stages run in-process on one device; in a pod with several GPUs they run under
`torchrun --standalone --nproc_per_node <GPUs>` (DeepSpeed picks the ranks up from torchrun's
environment); PPO with `kubernetes.ppo_nodes > 1` becomes a Kubeflow Trainer TrainJob
(kubealign.cluster.trainjob).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_from_json, config_to_yaml
from kubealign.errors import UserError
from kubealign.outputs import read_result
from kubealign.training.distributed import RENDEZVOUS_ENV

# Pinned when the pipeline is compiled, on the tasks' containers (pipelines/dag.py: Tasks), where a run's
# parameters cannot reach: the sha256 of the reward functions the pipeline embedded (on the tasks that read
# them), and the config sections allowed to run a model's own code (on every task). A run that edits the
# parameters `reward_functions` or `config_json` cannot run other code than what was compiled.
FUNCTIONS_SHA_ENV, REMOTE_CODE_ENV = "KUBEALIGN_REWARD_FUNCTIONS_SHA256", "KUBEALIGN_TRUST_REMOTE_CODE"
REMOTE_CODE_SECTIONS = ("sft", "reward", "dpo")


def pins(config: KubealignConfig, functions_json: str) -> dict[str, str]:
    """What a compiled pipeline pins on its tasks (see FUNCTIONS_SHA_ENV)."""
    trusted = [s for s in REMOTE_CODE_SECTIONS if getattr(config, s).trust_remote_code]
    return {FUNCTIONS_SHA_ENV: hashlib.sha256(functions_json.encode()).hexdigest(), REMOTE_CODE_ENV: ",".join(trusted)}


def load(config_json: str, overrides: list[str] | None = None) -> KubealignConfig:
    config = config_from_json(config_json, overrides)
    allowed = os.environ.get(REMOTE_CODE_ENV)
    if allowed is not None:  # a compiled pipeline's task
        for section in REMOTE_CODE_SECTIONS:
            if getattr(config, section).trust_remote_code and section not in allowed.split(","):
                raise UserError(
                    f"{section}.trust_remote_code is true in this run's config_json but the pipeline was compiled "
                    "without it: a run's parameters cannot allow a model's own code; compile the pipeline with it"
                )
    return config


def device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(nproc: int, cli_args: list[str], nnodes_from_env: bool = False) -> list[str]:
    """`torchrun ... -m kubealign.cli ARGS`: standalone on one pod, or from PET_* env on a TrainJob node."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes_from_env:  # the Trainer's torch plugin sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR ...
        return [*launcher, "-m", "kubealign.cli", *cli_args]
    return [*launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", "kubealign.cli", *cli_args]


def _run_distributed(config: KubealignConfig, nproc: int, cli_args: list[str], output: Path) -> dict[str, Any]:
    """Run `kubealign <cli_args> --config <resolved yaml>` on nproc local ranks and read its result."""
    with tempfile.TemporaryDirectory(prefix="kubealign-task-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(config_to_yaml(config), encoding="utf-8")
        command = torchrun_command(nproc, [*cli_args, "--config", str(config_file)])
        print("launching:", " ".join(command), flush=True)
        env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}  # a job of its own
        code = subprocess.run(command, check=False, env=env).returncode
    if code != 0:
        raise RuntimeError(f"{cli_args[0]} on {nproc} ranks exited with code {code}")
    return read_result(output)


# Set by the DAG on training tasks when kubernetes.pvc is given (pipelines/dag.py): the checkpoint root on
# the PVC, the pipeline run (the `pipeline/runid` label KFP puts on its pods, through the downward API) and
# the task's name. A retried pod of the same task in the same run gets the same three.
CHECKPOINT_ROOT_ENV, RUN_ID_ENV, TASK_ENV = "KUBEALIGN_CHECKPOINT_ROOT", "KUBEALIGN_RUN_ID", "KUBEALIGN_TASK"


def checkpoint_location(environ: dict[str, str] | None = None) -> tuple[Path | None, bool]:
    """(where this task keeps its checkpoints, whether to resume from them).

    On the cluster with a PVC: ROOT/RUN/TASK, so that a pod retried after a preemption, an eviction or a crash
    finds what its predecessor saved and resumes (a fresh task finds nothing there and starts). Anywhere else
    (kfp.local, no PVC, no run label): (None, False), the stage's default beside its output."""
    env = os.environ if environ is None else environ
    root, run, task = (env.get(key, "").strip() for key in (CHECKPOINT_ROOT_ENV, RUN_ID_ENV, TASK_ENV))
    if not (root and run and task):
        return None, False
    for label, value in (("run", run), ("task", task)):
        if "/" in value or value in (".", ".."):
            raise UserError(f"{RUN_ID_ENV if label == 'run' else TASK_ENV}={value!r} is not a directory name")
    location = Path(root) / run / task
    resume = location.is_dir() and any(location.iterdir())
    print(f"checkpoints: {location}" + (" (resuming from them)" if resume else ""), flush=True)
    return location, resume


def _tidy(location: Path | None, result: dict[str, Any]) -> dict[str, Any]:
    """After a stage finished (it removed its own checkpoints): the run's directory on the PVC, once empty."""
    if location is not None:
        with contextlib.suppress(OSError):  # not empty: another task of the run still keeps checkpoints there
            location.parent.rmdir()
    return result


def _checkpoint_args(location: Path | None, resume: bool) -> list[str]:
    """The CLI form of checkpoint_location's answer, for a torchrun or TrainJob process."""
    return ([] if location is None else ["--checkpoints", str(location)]) + (["--resume"] if resume else [])


def data_split(config_json: str, overrides: list[str], output: str) -> dict[str, Any]:
    from kubealign.stages import data_split as stage

    return stage.run(load(config_json, overrides), Path(output))


def train(stage_name: str, config_json: str, overrides: list[str], data: str, model: str, output: str) -> dict:
    """sft, reward or dpo (model: the SFT output dir to start from): in-process on <= 1 GPU, under torchrun on a
    multi-GPU pod."""
    config = load(config_json, overrides)
    location, resume = checkpoint_location()
    nproc = device_count()
    if nproc > 1:
        args = [stage_name, "--data", data, "--output", output] + (["--model", model] if model else [])
        return _tidy(location, _run_distributed(config, nproc, args + _checkpoint_args(location, resume), Path(output)))
    if stage_name == "sft":
        from kubealign.stages import sft as stage
    elif stage_name == "reward":
        from kubealign.stages import reward as stage
    elif stage_name == "dpo":
        from kubealign.stages import dpo as stage
    else:
        raise UserError(f"unknown training stage {stage_name!r} (expected sft, reward or dpo)")
    return _tidy(location, stage.run(config, Path(data), model or None, Path(output), resume, location))


def reward_functions(config: KubealignConfig, functions_json: str) -> list:
    """The reward functions a task scores with: as the compiled pipeline embedded them (functions_json, from
    kubealign.rewards.definitions.to_json), checked against config.rewards; none when the config has none."""
    from kubealign.rewards import definitions

    pinned = os.environ.get(FUNCTIONS_SHA_ENV)
    digest = hashlib.sha256(functions_json.encode()).hexdigest()
    if pinned is not None and digest != pinned:
        raise UserError(
            f"reward_functions: sha256 {digest[:12]}… is not the {pinned[:12]}… compiled into the pipeline: the "
            "parameter was edited after compiling; compile the pipeline with the functions it should run"
        )
    specs = definitions.from_json(functions_json) if functions_json else []
    if config.rewards.functions and not specs:
        raise UserError("rewards.functions are set but the task got no reward_functions: compile the pipeline again")
    definitions.check_matches(specs, config.rewards)
    return specs


def _functions_file(specs: list, directory: Path) -> list[str]:
    """CLI args handing the embedded functions to a `kubealign ppo|evaluate` process (torchrun, a TrainJob)."""
    from kubealign.rewards import definitions

    if not specs:
        return []
    path = directory / "reward_functions.json"
    path.write_text(definitions.to_json(specs), encoding="utf-8")
    return ["--reward-functions", str(path)]


def ppo(
    config_json: str, overrides: list[str], prompts: str, actor: str, critic: str, output: str, functions_json: str = ""
) -> dict:
    """PPO in-process, under torchrun on a multi-GPU pod, or as a multi-node TrainJob. critic: the reward
    model's dir (critic and reward), or with reward functions alone the SFT dir (ppo's critic start)."""
    config = load(config_json, overrides)
    specs = reward_functions(config, functions_json)
    location, resume = checkpoint_location()
    if config.kubernetes.ppo_nodes > 1:
        return _tidy(location, ppo_trainjob(config, prompts, actor, critic, output, specs, location, resume))
    nproc = device_count()
    if nproc > 1:
        with tempfile.TemporaryDirectory(prefix="kubealign-fns-") as tmp:
            args = ["ppo", "--prompts", prompts, "--actor", actor, "--critic", critic, "--output", output]
            args += _functions_file(specs, Path(tmp)) + _checkpoint_args(location, resume)
            return _tidy(location, _run_distributed(config, nproc, args, Path(output)))
    from kubealign.stages import ppo as stage

    paths = (Path(prompts), Path(actor), Path(critic), None, Path(output))
    return _tidy(location, stage.run(config, *paths, resume=resume, functions=specs, checkpoint_location=location))


def ppo_trainjob(
    config: KubealignConfig,
    prompts: str,
    actor: str,
    critic: str,
    output: str,
    specs: list,
    location: Path | None = None,
    resume: bool = False,
) -> dict:
    """Stage the inputs on the shared PVC, run PPO as a TrainJob, copy the actor back; the staging directory
    is removed on every exit this process lives through (a SIGKILLed try's is replaced by the retry's).

    The TrainJob's name comes from the run and task (checkpoint_location's keys) when the pod has them, so a
    retry finds and replaces its predecessor's TrainJob, and the new one resumes from LOCATION."""
    from kubealign.cluster import trainjob
    from kubealign.images import train_image
    from kubealign.training import preemption

    k8s = config.kubernetes
    key = f"{os.environ[RUN_ID_ENV]}/{os.environ[TASK_ENV]}" if location is not None else f"{output}{os.getpid()}"
    name = f"kubealign-ppo-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    shared = Path(k8s.pvc_mount) / "trainjobs" / name
    custom, core = trainjob.connect()
    with preemption.raising("ppo"):
        try:
            trainjob.replace_leftover(custom, name, k8s.namespace, timeout_s=k8s.grace_period_s + 60)
            shutil.rmtree(shared, ignore_errors=True)  # the predecessor's staging (the name is this task's)
            for label, source in (("prompts", prompts), ("actor", actor), ("critic", critic)):
                shutil.copytree(source, shared / label)
            (shared / "config.yaml").write_text(config_to_yaml(config), encoding="utf-8")
            cli_args = ["ppo", "--config", str(shared / "config.yaml"), "--output", str(shared / "output")]
            for label in ("prompts", "actor", "critic"):
                cli_args += [f"--{label}", str(shared / label)]
            cli_args += _functions_file(specs, shared) + _checkpoint_args(location, resume)
            env = {key: os.environ[key] for key in _FORWARDED_ENV if key in os.environ}
            image = k8s.train_image or train_image()
            owners = trainjob.owner_references(dict(os.environ), k8s.namespace)
            body = trainjob.manifest(name, k8s, image, torchrun_command(0, cli_args, True), env, owners)
            trainjob.run(custom, core, body, k8s.trainjob_timeout_s)
            shutil.copytree(shared / "output", output, dirs_exist_ok=True)
        finally:
            shutil.rmtree(shared, ignore_errors=True)
    return read_result(Path(output))


# MLflow location and nesting travel from the task's pod into the TrainJob's pods (credentials do not:
# the nodes read them from the same Secrets, see trainjob.secret_env).
_FORWARDED_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_RUN_ID",
    "KUBEALIGN_PARENT_RUN_ID",
)


def evaluate(
    config_json: str,
    overrides: list[str],
    prompts: str,
    baseline: str,
    candidate: str,
    reward: str,
    output: str,
    functions_json: str = "",
) -> dict[str, Any]:
    """reward: the reward model's dir (not read when rewards.model_weight is 0 with functions)."""
    from kubealign.stages import evaluate as stage

    config = load(config_json, overrides)
    specs = reward_functions(config, functions_json)
    paths = (Path(prompts), Path(baseline), Path(candidate), Path(reward), Path(output))
    return stage.run(config, *paths, functions=specs)


def promote(
    config_json: str,
    overrides: list[str],
    evaluation: str,
    model_dir: str,
    output: str,
    comparison: str = "",
    name: str = "",
) -> dict[str, Any]:
    """comparison: the compare stage's output when several candidates ran (only its leader moves aliases);
    name: the candidate's name there (default: its route's)."""
    from kubealign.stages import promote as stage

    ranked = Path(comparison) if comparison else None
    config = load(config_json, overrides)
    return stage.run(config, Path(evaluation), Path(model_dir), Path(output), ranked, name or None)


def setting_overrides(settings_json: str) -> list[str]:
    """A candidate's settings (the DAG's JSON object of dotted keys) as --set overrides."""
    from kubealign.selection.candidates import as_overrides

    return as_overrides(json.loads(settings_json or "{}"))


def serve(config_json: str, overrides: list[str], promotion: str, output: str) -> dict[str, Any]:
    """promotion: promote's output; the InferenceService of serve.alias, when promote moved it."""
    from kubealign.stages import serve as stage

    return stage.run(load(config_json, overrides), Path(promotion), Path(output))


def judge(
    config_json: str, overrides: list[str], prompts: str, tokenizer: str, reward: str, serving: str, output: str
) -> dict[str, Any]:
    """serving: the serve task's output; its canary judged online, the verdict carried out (canary.act).
    reward: the reward model (not read when the reward functions alone score)."""
    from kubealign.stages import judge_task as stage

    config = load(config_json, overrides)
    scorer = Path(reward) if config.rewards.uses_model else None
    return stage.run(config, Path(prompts), Path(tokenizer), scorer, Path(serving), Path(output))


def judge_report(judgement_dir: str, markdown_path: str) -> None:
    """judge.md as the KFP Markdown artifact (the reason there was nothing to judge, when there was not)."""
    from kubealign.outputs import read_result

    source = Path(judgement_dir) / "judge.md"
    text = source.read_text(encoding="utf-8") if source.is_file() else f"# {read_result(Path(judgement_dir))['why']}\n"
    Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
    Path(markdown_path).write_text(text, encoding="utf-8")


def compare(
    config_json: str,
    overrides: list[str],
    candidates: list[dict[str, Any]],
    evaluations: dict[str, str | None],
    output: str,
    max_kl: float = 0.0,
) -> dict[str, Any]:
    """candidates: [{name, algorithm, set}] (kubealign.selection.candidates.Candidate.as_dict); evaluations: name -> its
    evaluate output, None where the candidate failed. max_kl: pipeline.max_kl, 0 = none (the DAG's
    config_json has no pipeline section: that would put the budget in every task's cache key)."""
    from kubealign.selection.candidates import Candidate
    from kubealign.stages import compare as stage

    listed = [Candidate(c["name"], c["algorithm"], c.get("set") or {}) for c in candidates]
    paths = {name: None if path is None else Path(path) for name, path in evaluations.items()}
    budget = [f"pipeline.max_kl={max_kl!r}"] if max_kl else []
    return stage.run(load(config_json, [*overrides, *budget]), listed, paths, Path(output))


def write_leaderboard(comparison_dir: str, markdown_path: str, html_path: str) -> None:
    """The comparison's leaderboard as the KFP Markdown and HTML artifacts."""
    import shutil

    for name, target in (("leaderboard.md", markdown_path), ("frontier.html", html_path)):
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(comparison_dir) / name, target)


def roc(reward_dir: str) -> tuple[list[float], list[float], list[float], list[list[int]]]:
    """(fpr, tpr, thresholds, confusion matrix) of the RM's held-out pairs, for a KFP ClassificationMetrics.

    The ROC treats every response alone (label: was it the chosen one). The confusion matrix is pairwise,
    which is what a reward model is trained for: in each pair the higher-scored response is predicted
    "chosen", so rows [rejected, chosen] x predicted [rejected, chosen] hold accuracy on the diagonal.
    """
    import json

    scores = json.loads((Path(reward_dir) / "eval_scores.json").read_text(encoding="utf-8"))
    labels, values = scores["labels"], scores["scores"]
    half = len(labels) // 2  # chosen scores first, then the rejected ones in the same pair order
    right = sum(c > r for c, r in zip(values[:half], values[half:], strict=True))
    matrix = [[right, half - right], [half - right, right]]
    # sklearn's first threshold is +inf, stored as null; KFP wants finite numbers
    top = max(values) + 1.0
    thresholds = [top if t is None else t for t in scores["thresholds"]]
    return scores["fpr"], scores["tpr"], thresholds, matrix


def to_kfp(result: dict[str, Any], metrics: Any, artifact: Any) -> None:
    """Hand a stage result to KFP: numeric metrics into the Metrics artifact (the UI's metrics table)
    and onto the output artifact's metadata, with the stage name."""
    numeric = {k: float(v) for k, v in result.get("metrics", {}).items() if isinstance(v, int | float)}
    for key, value in numeric.items():
        metrics.log_metric(key, value)
    artifact.metadata.update({"stage": result.get("stage", ""), **numeric})
    persist(metrics)


def persist(*artifacts: Any) -> None:
    """Write metadata-only artifacts (Metrics, ClassificationMetrics) to their path as JSON.

    KFP keeps their content in metadata and never writes a file, and kfp.local's cache treats an
    artifact without a file as missing, so every rerun would miss the cache. A file also gives the
    artifact store a copy of the numbers."""
    import json

    for artifact in artifacts:
        path = Path(artifact.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(artifact.metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def held_aliases(promote_result: dict[str, Any]) -> str:
    """The registry aliases the new version holds after promotion, e.g. "challenger,champion"."""
    version = promote_result["version"]
    return ",".join(sorted(a for a, v in promote_result["aliases"].items() if v == version))


def write_report(evaluation_dir: str, html_path: str, markdown_path: str) -> None:
    """One self-contained HTML page (the samples table with the plots inlined as data: URIs, since the
    KFP UI shows a single file) and the Markdown sample table."""
    import base64

    directory = Path(evaluation_dir)
    page = (directory / "samples.html").read_text(encoding="utf-8")
    images = "".join(
        f"<h2>{png.stem.replace('_', ' ')}</h2><img alt='{png.stem}' "
        f"src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'>\n"
        for png in sorted(directory.glob("*.png"))
    )
    Path(html_path).parent.mkdir(parents=True, exist_ok=True)
    Path(html_path).write_text(page.replace("</body>", images + "</body>"), encoding="utf-8")
    shutil.copyfile(directory / "samples.md", markdown_path)
