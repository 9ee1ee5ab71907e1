"""The `kubealign` command line: every command's options and help (kubealign.cli runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kubealign import __version__
from kubealign.cli import feedback
from kubealign.shape import ACT, JUDGE, ROUTES, SERVE, SHARED


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file or preset name (default: the tiny-cpu preset, configs/tiny-cpu.yaml)",
    )
    _add_set_option(parser)


def _add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config field (repeatable); VALUE is YAML, e.g. --set data.split_ratios=[1,1,1]",
    )


def _add_pipeline_config(parser: argparse.ArgumentParser) -> None:
    """The pipeline commands take the config as a positional (`kubealign run [CONFIG]`) or as --config, the
    stage commands' spelling (`kubealign run --config tiny-cpu-verifiable`), plus --set."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="YAML file or preset (default: tiny-cpu)")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same as the positional CONFIG")
    _add_set_option(parser)


def _add_functions_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reward-functions",
        type=Path,
        metavar="JSON",
        help="the reward functions with their source, as a pipeline task hands them on (default: rewards.functions)",
    )


def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint (--checkpoints)")
    parser.add_argument(
        "--checkpoints",
        type=Path,
        metavar="CKPT_DIR",
        help="where the checkpoints go (default: DIR.checkpoints beside --output; a pipeline task uses the PVC)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubealign",
        description="RLHF (SFT, reward model, PPO with DeepSpeed's Hybrid Engine) as a Kubeflow pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"kubealign {__version__}")
    # The deepspeed launcher puts --local_rank=N right after the script name (torchrun sets LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_training_commands(sub)
    _add_judging_commands(sub)
    _add_pipeline_commands(sub)
    _add_image_commands(sub)
    _add_tool_commands(sub)
    return parser


def _add_training_commands(sub: Any) -> None:
    """data-split and the training stages: sft, reward, dpo, ppo."""
    split = sub.add_parser(
        "data-split",
        help="stage 0: normalize, validate, deduplicate and split data into the three phases",
        description="Read data.sources, normalize rows to {prompt, chosen, rejected}, drop bad rows, split "
        "unique prompts into phase1_sft / phase2_reward / phase3_prompts and write a manifest.",
    )
    _add_config_options(split)
    split.add_argument(
        "--source",
        dest="sources",
        action="append",
        default=[],
        metavar="PATH",
        help="input file, dataset dir or hub name (repeatable); replaces data.sources",
    )
    split.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    split.add_argument("--force", action="store_true", help="recompute even when the cache key matches")

    for stage, phase, what in (
        ("sft", "phase1_sft", "stage 1: supervised fine-tuning on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("reward", "phase2_reward", "stage 2: reward model (Bradley-Terry) on DeepSpeed (ZeRO 0-3, LoRA)"),
        ("dpo", "phase2_reward", "the dpo route: DPO from the SFT model on the preference pairs (ZeRO 0-3, LoRA)"),
    ):
        train = sub.add_parser(stage, help=what, description=what)
        _add_config_options(train)
        train.add_argument(
            "--data",
            required=True,
            type=Path,
            metavar="SPLIT_DIR",
            help=f"data-split output (or its {phase} dir)",
        )
        what_model = "policy to start from, the SFT output dir" if stage == "dpo" else "model to train"
        train.add_argument("--model", metavar="NAME_OR_DIR", help=f"{what_model} (default: {stage}.model)")
        train.add_argument("--output", required=True, type=Path, metavar="DIR", help="output model directory")
        _add_checkpoint_options(train)

    ppo = sub.add_parser(
        "ppo",
        help="stage 3: PPO with the DeepSpeed Hybrid Engine (actor, reference, critic, reward)",
        description="PPO (GRPO, RLOO: ppo.algorithm) on phase-3 prompts: actor and reference from the SFT dir, the "
        "score from the reward model (--reward, else --critic) and / or the reward functions of rewards.functions. "
        "The critic (ppo only): --critic, else the reward model, else the SFT model with a new value head.",
    )
    _add_config_options(ppo)
    ppo.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output (or phase3)")
    ppo.add_argument("--actor", required=True, type=Path, metavar="SFT_DIR", help="SFT model dir (actor + reference)")
    ppo.add_argument("--critic", type=Path, metavar="RM_DIR", help="critic start (ppo; default: the reward model)")
    ppo.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model (default: --critic; none: rewards.model_weight 0)"
    )
    ppo.add_argument("--output", required=True, type=Path, metavar="DIR", help="output actor directory")
    _add_functions_option(ppo)
    _add_checkpoint_options(ppo)


def _add_judging_commands(sub: Any) -> None:
    """evaluate, promote, rollback, judge."""
    evaluate = sub.add_parser(
        "evaluate",
        help="stage 4: compare the PPO candidate with the SFT baseline on held-out prompts",
        description="Sample baseline and candidate on phase-3 eval prompts with the same seed, score both with "
        "the reward model and / or the reward functions (rewards.functions; their means as fn/NAME/baseline and "
        "fn/NAME/candidate); win-rate, KL, lengths, perplexity, sample table and plots.",
    )
    _add_config_options(evaluate)
    evaluate.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output")
    evaluate.add_argument("--baseline", required=True, type=Path, metavar="SFT_DIR", help="baseline model dir")
    evaluate.add_argument("--candidate", required=True, type=Path, metavar="PPO_DIR", help="candidate model dir")
    evaluate.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model dir (none with rewards.model_weight 0)"
    )
    evaluate.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    _add_functions_option(evaluate)

    promote = sub.add_parser(
        "promote",
        help="stage 5: register the actor in the MLflow registry; move aliases if the gate passes",
        description="Register a model version (challenger); make it champion if it passes promote.* thresholds "
        "and beats the current champion. The old champion keeps previous-champion.",
    )
    _add_config_options(promote)
    promote.add_argument("--evaluation", required=True, type=Path, metavar="EVAL_DIR", help="evaluate stage output")
    promote.add_argument("--model-dir", required=True, type=Path, metavar="PPO_DIR", help="the evaluated candidate")
    promote.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory (result.json)")
    rollback = sub.add_parser("rollback", help="move the champion alias back to previous-champion")
    _add_config_options(rollback)
    rollback.add_argument(
        "--namespace", metavar="NS", help="also serve that champion there (its InferenceService applied, no canary)"
    )

    judge = sub.add_parser(
        "judge",
        help="judge a canary online: the same held-out prompts to the champion's and the canary's servers",
        description="Send the first canary.prompts phase-3 prompts to both OpenAI-compatible servers (greedy), "
        "count every failed request, score the answers both gave as evaluate scores samples and compare them, the "
        "champion as the baseline; decide by canary.min_answers, canary.max_error_rate, canary.max_latency_p95_s "
        "and the promote gate on the online numbers. Writes result.json, answers.json, judge.md.",
    )
    _add_config_options(judge)
    judge.add_argument("--champion", metavar="URL", help="the champion's server (http://host:port)")
    judge.add_argument("--canary", metavar="URL", help="the canary's server")
    judge.add_argument(
        "--front",
        metavar="URL",
        help="instead of --champion/--canary: the front of `kubealign serve --canary` (both servers behind it); "
        "with --act the verdict is served there too",
    )
    judge.add_argument("--prompts", required=True, type=Path, metavar="SPLIT_DIR", help="data-split output")
    judge.add_argument(
        "--tokenizer", required=True, type=Path, metavar="DIR", help="the policy's tokenizer (a model dir)"
    )
    judge.add_argument(
        "--reward", type=Path, metavar="RM_DIR", help="reward model dir (none with rewards.model_weight 0)"
    )
    judge.add_argument(
        "--served-name", metavar="NAME", help="model name on both servers (default: promote.registered_model)"
    )
    judge.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    judge.add_argument(
        "--act",
        action="store_true",
        help="carry out the verdict in the registry ($MLFLOW_TRACKING_URI): challenger becomes champion, or is "
        "cleared and tagged rejected",
    )
    judge.add_argument(
        "--namespace", metavar="NS", help="with --act: also serve the champion alone there (the canary removed)"
    )


def _add_pipeline_commands(sub: Any) -> None:
    """The DAG: run (kfp.local), compile, submit, upload, rerun."""
    run = sub.add_parser(
        "run",
        help="the whole DAG on this machine through kfp.local (the embedded default: tiny models, synthetic data)",
        description="Run data-split -> sft || reward -> ppo -> evaluate -> promote as the KFP pipeline, each task a "
        "subprocess (kfp.local SubprocessRunner), tracking to a local MLflow store (or $MLFLOW_TRACKING_URI).",
    )
    _add_pipeline_config(run)
    run.add_argument("--output", type=Path, default=Path("runs/demo"), metavar="DIR", help="default: runs/demo")
    run.add_argument("--cache", action="store_true", help="reuse tasks whose inputs are unchanged (kfp.local cache)")
    run.add_argument(
        "--runner",
        choices=["subprocess", "docker"],
        default="subprocess",
        help="subprocess (default): each task a process of this Python environment; docker: each task in the "
        "CPU image (make images) through kfp.local's DockerRunner",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="stream every task's output as kfp.local does (default: one line per task; full output in DIR/logs/)",
    )

    compile_ = sub.add_parser("compile", help="write the pipeline as KFP IR YAML (for the UI or kfp.Client)")
    _add_pipeline_config(compile_)
    compile_.add_argument("-o", "--output", type=Path, default=Path("pipeline.yaml"), metavar="FILE")

    submit = sub.add_parser("submit", help="compile and start a run on a Kubeflow Pipelines API (kfp.Client)")
    _add_pipeline_config(submit)
    submit.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint, e.g. http://localhost:8080")
    submit.add_argument("--experiment", help="KFP experiment (default: tracking.experiment)")
    submit.add_argument("--run-name", help="run name (default: kubealign-<timestamp>)")
    submit.add_argument("--namespace", help="profile namespace on multi-user Kubeflow")
    submit.add_argument("--no-cache", action="store_true", help="run every task even if KFP has a cached result")
    submit.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")
    submit.add_argument(
        "--no-parent-run", action="store_true", help="do not create a parent MLflow run for the pipeline run"
    )

    upload = sub.add_parser("upload", help="compile and upload the pipeline to KFP (new pipeline or new version)")
    _add_pipeline_config(upload)
    upload.add_argument("--host", required=True, metavar="URL", help="KFP API endpoint")
    upload.add_argument(
        "--pipeline-name", default="kubealign-rlhf", help="pipeline name in KFP (default: kubealign-rlhf)"
    )
    upload.add_argument("--token", help="bearer token (default: $KFP_TOKEN, else kfp's own auth)")

    rerun = sub.add_parser("rerun", help="rerun one stage (and optionally its downstream) on an earlier run's outputs")
    rerun.add_argument(
        "stage",
        metavar="STAGE",
        help=f"a stage ({', '.join([*SHARED, *ROUTES, 'evaluate', 'promote', SERVE, JUDGE, ACT])}; {ACT}: the "
        "judge's verdict carried out again, which finishes one carried out halfway); in a run comparing several "
        "candidates, a candidate's name (its training, evaluation, then the comparison and the promotions) or compare",
    )
    rerun.add_argument(
        "--from", dest="run", required=True, type=Path, metavar="RUN_DIR", help="--output of an earlier `kubealign run`"
    )
    rerun.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field of that run's config (repeatable)",
    )
    rerun.add_argument("--downstream", action="store_true", help="also rerun every stage that depends on it")
    rerun.add_argument("--output", type=Path, metavar="DIR", help="default: RUN_DIR-rerun-STAGE-<timestamp>")


def _add_image_commands(sub: Any) -> None:
    """images build / daemon."""
    images_ = sub.add_parser("images", help="build the container images offline; a private Docker daemon for them")
    images_sub = images_.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    build = images_sub.add_parser(
        "build",
        help="build an image from a wheelhouse of the lock, with no network inside the build",
        description="Makes (once per lock) a wheelhouse of the locked dependencies, stages it with the image's "
        "Dockerfile and builds with --no-index and no network. Uses $DOCKER_HOST, else kubealign's daemon "
        "(`kubealign images daemon start`), else /var/run/docker.sock.",
    )
    build.add_argument(
        "--image",
        choices=["cpu", "train", "serve"],
        default="cpu",
        help="which image (default: cpu; serve: vLLM's CPU server for KServe's vllm runtime)",
    )
    build.add_argument(
        "--base",
        default="auto",
        metavar="auto|bootstrap|IMAGE",
        help="base of the image: auto (the Python image if it can be had, else bootstrap), bootstrap (Debian "
        "bookworm made here with debootstrap) or an image the daemon has (Python 3.11 with venv, headers, g++)",
    )
    build.add_argument(
        "--cuda-arch-list",
        metavar="ARCHS",
        help="train image: TORCH_CUDA_ARCH_LIST to compile DeepSpeed's ops for (default: the Dockerfile's "
        "'8.0;8.6;8.9;9.0'; each arch adds build time)",
    )
    daemon_ = images_sub.add_parser("daemon", help="start, stop or show kubealign's private dockerd")
    daemon_.add_argument("action", choices=["start", "stop", "status"])


def _add_tool_commands(sub: Any) -> None:
    """summary, tiny-model, config; registry and serve: _add_registry_commands."""
    summary = sub.add_parser("summary", help="one-screen summary of a run directory (as make demo writes)")
    summary.add_argument("run_dir", nargs="?", type=Path, default=Path("runs/demo"), help="default: runs/demo")

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny (2-layer, width-128) model with a locally trained tokenizer",
        description="Build tiny-opt or tiny-llama from config (no download) into an HF model dir.",
    )
    tiny.add_argument("--arch", required=True, choices=["opt", "llama"], help="architecture")
    tiny.add_argument("--output", required=True, type=Path, metavar="DIR", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights and tokenizer (default 0)")

    config = sub.add_parser("config", help="inspect configurations")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved config (defaults, file, --set)")
    _add_config_options(show)
    config_sub.add_parser("presets", help="list the shipped presets")
    _add_registry_commands(sub)
    feedback.add_parser(sub)


def _add_registry_commands(sub: Any) -> None:
    """registry auth-config | identities (what the chart's MLflow pods run), and serve."""
    registry = sub.add_parser(
        "registry",
        help="the chart's MLflow with authentication: its config file and its identities (run by the chart's pods)",
        description="auth-config writes MLflow's basic-auth ini for the database in $MLFLOW_AUTH_DATABASE_URI; "
        "identities signs in as the admin (MLFLOW_TRACKING_USERNAME / _PASSWORD) and creates the pipeline, tracker "
        "and reader identities from KUBEALIGN_PIPELINE_, KUBEALIGN_TRACKER_ and KUBEALIGN_READER_USERNAME / _PASSWORD "
        "(or sets their passwords again). docs/reliability.md 'Trust boundaries'.",
    )
    registry_sub = registry.add_subparsers(dest="registry_command", metavar="ACTION", required=True)
    auth_config = registry_sub.add_parser("auth-config", help="write the basic-auth ini (MLFLOW_AUTH_CONFIG_PATH)")
    auth_config.add_argument("--output", required=True, type=Path, metavar="FILE", help="the ini file to write")
    identities = registry_sub.add_parser("identities", help="create the pipeline, tracker and reader identities")
    identities.add_argument("--tracking-uri", required=True, metavar="URL", help="the MLflow server")
    identities.add_argument(
        "--wait", type=float, default=300.0, metavar="S", help="seconds to wait for the server to answer (default 300)"
    )
    identities.add_argument(
        "--registered-model",
        action="append",
        default=[],
        metavar="NAME",
        help="a registered model the pipeline promotes to: created if absent, the pipeline identity's (MANAGE), "
        "the tracker's and the reader's to read only (repeatable)",
    )
    identities.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="NAME",
        help="an experiment the pipeline logs to (tracking.experiment): created if absent, the pipeline identity's "
        "(MANAGE), the tracker may log runs in it (EDIT), the reader reads (repeatable)",
    )

    serve = sub.add_parser(
        "serve",
        help="serve a registry alias here with vLLM's OpenAI server, or write its KServe InferenceService",
        description="Resolve ALIAS of the registered model to its version and check that version's Hugging Face "
        "directory (config, safetensors, tokenizer). Without --manifest: serve it on 127.0.0.1:PORT with vLLM's "
        "OpenAI-compatible server (the runtime KServe runs; its venv is created on first use). With --manifest: "
        "write the InferenceService (serving.kserve.io/v1beta1) whose storageUri is that directory in the artifact "
        "store (serve.artifacts_destination for a server that serves its artifacts). Settings: the serve section.",
    )
    _add_config_options(serve)
    serve.add_argument("--tracking-uri", metavar="URI", help="the registry (default: $MLFLOW_TRACKING_URI)")
    serve.add_argument("--model", metavar="NAME", help="registered model (default: promote.registered_model)")
    serve.add_argument("--alias", metavar="ALIAS", help="the alias served (default: serve.alias, champion)")
    serve.add_argument("--namespace", metavar="NS", help="namespace of the InferenceService (default: serve.namespace)")
    serve.add_argument(
        "--manifest", type=Path, metavar="FILE", help="write the InferenceService here instead of serving here"
    )
    serve.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000), without --manifest")
    serve.add_argument(
        "--canary",
        metavar="ALIAS",
        help="serve this alias (e.g. challenger) beside --alias with its share of the traffic: here, both servers "
        "behind a front on --port; with --manifest, as the InferenceService's canary",
    )
    serve.add_argument(
        "--canary-percent",
        type=int,
        metavar="N",
        help="the canary's share of the traffic, 1-99 %% (default: canary.percent, 10)",
    )
