"""What each Kubeflow task runs, in plain paths and strings (the library still never imports kfp).

The components in kubealign.components are declarations only: typed KFP inputs/outputs and one call
into a function here, which takes the pipeline parameter `config_json` plus overrides for the
pipeline's common knobs, runs the stage and returns its result.json. `kubealign rerun` calls the same
functions, so a stage rerun on a laptop does exactly what the task does in a pod.

One function per task; each imports its stage by the stage's own name. How a training stage is launched
(in-process, torchrun, a TrainJob) and where it keeps its checkpoints is kubealign.tasks.launch; what a
component hands to KFP's artifacts afterwards is kubealign.tasks.artifacts; the names of the environment
variables a task's pod carries are kubealign.pod.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kubealign.config import KubealignConfig, config_from_json
from kubealign.errors import UserError
from kubealign.pod import FUNCTIONS_SHA_ENV, REMOTE_CODE_ENV, REMOTE_CODE_SECTIONS
from kubealign.tasks import launch


def pins(config: KubealignConfig, functions_json: str) -> dict[str, str]:
    """What a compiled pipeline pins on its tasks (see kubealign.pod.FUNCTIONS_SHA_ENV)."""
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


def data_split(config_json: str, overrides: list[str], output: str, feedback: str | None = None) -> dict[str, Any]:
    """feedback: the feedback task's output; its rows join data.sources (weight feedback.weight), when it has any."""
    from kubealign.stages import data_split as stage
    from kubealign.stages import feedback as people

    config = load(config_json, overrides)
    return stage.run(people.with_rows(config, Path(feedback)) if feedback else config, Path(output))


def feedback(config_json: str, output: str) -> dict[str, Any]:
    from kubealign.stages import feedback as stage

    return stage.run(load(config_json), Path(output))


def train(stage_name: str, config_json: str, overrides: list[str], data: str, model: str, output: str) -> dict:
    """sft, reward or dpo (model: the SFT output dir to start from): in-process on <= 1 GPU, under torchrun on a
    multi-GPU pod."""
    config = load(config_json, overrides)
    location, resume = launch.checkpoint_location()
    nproc = launch.device_count()
    if nproc > 1:
        args = [stage_name, "--data", data, "--output", output] + (["--model", model] if model else [])
        args += launch.checkpoint_args(location, resume)
        return launch.tidy(location, launch.run_distributed(config, nproc, args, Path(output)))
    inputs = (config, Path(data), model or None, Path(output), resume, location)
    if stage_name == "sft":
        from kubealign.stages import sft

        return launch.tidy(location, sft.run(*inputs))
    if stage_name == "reward":
        from kubealign.stages import reward

        return launch.tidy(location, reward.run(*inputs))
    if stage_name == "dpo":
        from kubealign.stages import dpo

        return launch.tidy(location, dpo.run(*inputs))
    raise UserError(f"unknown training stage {stage_name!r} (expected sft, reward or dpo)")


def reward_functions(config: KubealignConfig, functions_json: str) -> list:
    """The reward functions a task scores with: as the compiled pipeline embedded them (functions_json, from
    kubealign.usercode.definitions.to_json), checked against config.rewards; none when the config has none."""
    from kubealign.usercode import definitions

    pinned = os.environ.get(FUNCTIONS_SHA_ENV)
    digest = hashlib.sha256(functions_json.encode()).hexdigest()
    if pinned is not None and digest != pinned:
        raise UserError(
            f"reward_functions: sha256 {digest[:12]}… is not the {pinned[:12]}… compiled into the pipeline: the "
            "parameter was edited after compiling; compile the pipeline with the functions it should run"
        )
    specs = definitions.from_json(functions_json) if functions_json else []
    if (config.rewards.functions or config.tools.enabled) and not specs:
        raise UserError(
            "rewards.functions or tools are set but the task got no reward_functions: compile the pipeline again"
        )
    definitions.check_matches(specs, config.rewards, config.tools)
    return specs


def ppo(
    config_json: str, overrides: list[str], prompts: str, actor: str, critic: str, output: str, functions_json: str = ""
) -> dict:
    """PPO in-process, under torchrun on a multi-GPU pod, or as a multi-node TrainJob. critic: the reward
    model's dir (critic and reward), or with reward functions alone the SFT dir (ppo's critic start)."""
    config = load(config_json, overrides)
    specs = reward_functions(config, functions_json)
    location, resume = launch.checkpoint_location()
    if config.kubernetes.ppo_nodes > 1:
        return launch.tidy(
            location, launch.ppo_trainjob(config, prompts, actor, critic, output, specs, location, resume)
        )
    nproc = launch.device_count()
    if nproc > 1:
        with tempfile.TemporaryDirectory(prefix="kubealign-fns-") as tmp:
            args = ["ppo", "--prompts", prompts, "--actor", actor, "--critic", critic, "--output", output]
            args += launch.functions_file(specs, Path(tmp)) + launch.checkpoint_args(location, resume)
            return launch.tidy(location, launch.run_distributed(config, nproc, args, Path(output)))
    from kubealign.stages import ppo as stage

    paths = (Path(prompts), Path(actor), Path(critic), None, Path(output))
    return launch.tidy(
        location, stage.run(config, *paths, resume=resume, functions=specs, checkpoint_location=location)
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
    suites_fingerprint: str | None = None,
) -> dict[str, Any]:
    """reward: the reward model's dir (not read when rewards.model_weight is 0 with functions); suites_fingerprint:
    the compiled pipeline's pin of evaluate.suites (kubealign.answers.suites.fingerprint), None outside one."""
    from kubealign.answers import suites
    from kubealign.stages import evaluate as stage

    config = load(config_json, overrides)
    if suites_fingerprint is not None:  # before any model is loaded
        suites.check_pinned(config.evaluate.suites, config.base_dir, suites_fingerprint)
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
    from kubealign.config.candidates import as_overrides

    return as_overrides(json.loads(settings_json or "{}"))


def serve(config_json: str, overrides: list[str], promotion: str, output: str) -> dict[str, Any]:
    """promotion: promote's output; the InferenceService of serve.alias, when promote moved it."""
    from kubealign.stages import serve as stage

    return stage.run(load(config_json, overrides), Path(promotion), Path(output))


def judge(
    config_json: str, overrides: list[str], prompts: str, tokenizer: str, reward: str, serving: str, output: str
) -> dict[str, Any]:
    """serving: the serve task's output; its canary judged online, the verdict written (verdict.json), nothing
    moved. reward: the reward model (not read when the reward functions alone score)."""
    from kubealign.stages import judge_task

    config = load(config_json, overrides)
    scorer = Path(reward) if config.rewards.uses_model else None
    return judge_task.run(config, Path(prompts), Path(tokenizer), scorer, Path(serving), Path(output))


def act(config_json: str, overrides: list[str], judgement: str, output: str) -> dict[str, Any]:
    """judgement: the judge task's output; its verdict carried out (canary.act): the registry, then serving."""
    from kubealign.stages import act as stage

    return stage.run(load(config_json, overrides), Path(judgement), Path(output))


def settle(config_json: str, overrides: list[str], output: str) -> dict[str, Any]:
    """The canary the previous run left waiting for people (canary.await_people), decided on their choices and
    carried out: the registry, then serving."""
    from kubealign.stages import settle as stage

    return stage.run(load(config_json, overrides), Path(output))


def push(config_json: str, judgement: str, output: str) -> dict[str, Any]:
    """judgement: the judge task's output; the pairs its canary served, to people (feedback.project)."""
    from kubealign.stages import push as stage

    return stage.run(load(config_json), Path(judgement), Path(output))


def compare(
    config_json: str,
    overrides: list[str],
    candidates: list[dict[str, Any]],
    evaluations: dict[str, str | None],
    output: str,
    max_kl: float = 0.0,
) -> dict[str, Any]:
    """candidates: [{name, route, set}] (config.candidates.Candidate.as_dict); evaluations: name -> its
    evaluate output, None where the candidate failed. max_kl: pipeline.max_kl, 0 = none (the DAG's
    config_json has no pipeline section: that would put the budget in every task's cache key)."""
    from kubealign.config.candidates import Candidate
    from kubealign.stages import compare as stage

    listed = [Candidate.from_dict(c) for c in candidates]
    paths = {name: None if path is None else Path(path) for name, path in evaluations.items()}
    budget = [f"pipeline.max_kl={max_kl!r}"] if max_kl else []
    return stage.run(load(config_json, [*overrides, *budget]), listed, paths, Path(output))
