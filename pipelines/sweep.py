"""The DAG of several candidates (pipeline.candidates, a sweep expanded into one per grid point): the shared
data-split, SFT and reward tasks, a branch per candidate (its training task with its own settings, its
evaluation against the same SFT baseline), one compare task that ranks them and draws the reward-KL
frontier, and a promotion per candidate of which only the leader can move the aliases.

Each branch's tasks are named after the candidate (dpo-beta-0p05, evaluate-dpo-beta-0p05,
promote-dpo-beta-0p05) in the IR, the Kubeflow UI and kfp.local's logs. A candidate's settings are an input
of its training task only (a JSON object; config_json stays the run's shared config), so its cache key is
its own settings: adding a candidate to a cached run trains only that one.

pipeline.parallelism bounds the fan-out: candidate i (from 0) past the first `parallelism` waits for a slot,
a no-op task wait-NAME that runs once candidate i - parallelism's branch has ended, failed or not
(ignore_upstream_failure), so at most `parallelism` branches run at once and a failure blocks no one.
"""

# No `from __future__ import annotations` here: KFP reads the pipeline function's annotations as objects.
import json
from collections.abc import Callable
from copy import deepcopy
from typing import Any, NamedTuple

from kfp.dsl import Artifact, Dataset, Model

from kubealign.components import stages
from kubealign.config.candidates import MAX_CANDIDATES, Candidate
from kubealign.shape import WAIT_PREFIX, route_task


class RoutesOutputs(NamedTuple):
    """Outputs of a pipeline comparing several candidates: the shared tasks' and the comparison's (each candidate's
    candidate, evaluation and promotion are named in the comparison's result and in the task list)."""

    data_split: Dataset
    sft: Model
    reward: Model
    compare: Artifact


class RoutesFunctionOutputs(NamedTuple):
    """RoutesOutputs of a pipeline scored by reward functions alone: no reward task."""

    data_split: Dataset
    sft: Model
    compare: Artifact


def several_candidates(builder: Any, d: dict[str, Any]) -> Callable[..., Any]:
    """The pipeline of several candidates; `builder`: kubealign.pipelines.dag.Tasks, `d`: its parameters' defaults."""
    candidates = builder.config.candidates()
    parallelism = builder.config.pipeline.parallelism

    def kubealign_routes_pipeline(
        config_json: str = d["config_json"],
        sft_model: str = d["sft_model"],
        reward_model: str = d["reward_model"],
        ppo_num_iterations: int = d["ppo_num_iterations"],
        data_fingerprint: str = d["data_fingerprint"],
        sft_model_fingerprint: str = d["sft_model_fingerprint"],
        reward_model_fingerprint: str = d["reward_model_fingerprint"],
        reward_functions: str = d["reward_functions"],
    ):
        p = dict(locals())
        dataset, sft, scorer = builder.upstream(p)
        config_json = p["config_json"]  # the feedback task's, with feedback.project (dag.Tasks.data)
        models, evaluations, ends = {}, {}, []
        for number, candidate in enumerate(candidates):
            task = train(builder, candidate, p, dataset, sft, scorer)
            if parallelism and number >= parallelism:
                slot = named(stages.wait, f"{WAIT_PREFIX}{candidate.name}")().after(ends[number - parallelism])
                builder.place(slot.ignore_upstream_failure(), f"wait for a slot: {candidate.name}", 0, training=False)
                task.after(slot)
            models[candidate.name] = task.outputs["model"]
            component = named(stages.evaluate, f"evaluate-{candidate.name}")
            evaluation = builder.evaluate(component, p, dataset, sft, models[candidate.name], scorer)
            evaluation.set_display_name(f"evaluate {candidate.name}")
            evaluations[candidate.name] = evaluation.outputs["evaluation"]
            ends.append(evaluation)
        # only the candidates' inputs: kfp's ignore_upstream_failure() looks up every input of the component
        # among the task's arguments, and an optional input left out is not there (KeyError)
        absent = [f"evaluation_{n}" for n in range(len(candidates) + 1, MAX_CANDIDATES + 1)]
        comparison = named(stages.compare, "compare", drop=absent)(
            config_json=config_json,
            candidates=json.dumps([c.as_dict() for c in candidates]),
            max_kl=builder.config.pipeline.max_kl or 0.0,
            **{f"evaluation_{n}": evaluations[c.name] for n, c in enumerate(candidates, start=1)},
        )
        # A failed candidate must not sink the others: the comparison runs once every branch has ended, and
        # gets no evaluation from one that failed (its input's default, None).
        comparison.ignore_upstream_failure()
        builder.place(comparison, "compare: the reward-KL frontier", 0, training=False)
        for candidate in candidates:
            promote = named(stages.promote_ranked, f"promote-{candidate.name}")(
                config_json=config_json,
                candidate_name=candidate.name,
                comparison=comparison.outputs["comparison"],
                evaluation=evaluations[candidate.name],
                candidate=models[candidate.name],
            )
            builder.promote(promote, f"promote {candidate.name} (MLflow registry)")
        done = {"data_split": dataset, "sft": sft, "compare": comparison.outputs["comparison"]}
        return RoutesOutputs(reward=scorer, **done) if builder.with_model else RoutesFunctionOutputs(**done)

    return kubealign_routes_pipeline


def train(builder: Any, candidate: Candidate, p: dict[str, Any], dataset: Any, sft: Any, scorer: Any) -> Any:
    """The candidate's training task: the dpo component, or the ppo component with its route as the algorithm;
    its settings as the task's `settings` input (only when it has any: a route's default candidate compiles
    as it did before candidates existed)."""
    settings = {"settings": json.dumps(dict(candidate.settings), sort_keys=True)} if candidate.settings else {}
    shown = f"{candidate.name} ({candidate.route.upper()}"
    if route_task(candidate.route) == "dpo":
        return builder.dpo(named(stages.dpo, candidate.name), p, dataset, sft, f"{shown})", **settings)
    component = named(stages.ppo, candidate.name)
    label = f"{shown}, hybrid engine)"
    return builder.rl(component, p, candidate.route, dataset, sft, scorer, label, **settings)


def named(component: Any, name: str, drop: list[str] | None = None) -> Any:
    """A copy of `component` under another name: KFP names a task after its component, so each candidate's
    tasks get the candidate's name (grpo, evaluate-grpo, promote-grpo) in the IR, the UI and kfp.local's logs.
    The implementation (image, command, function) is the same, and so is the cache key. `drop`: optional
    inputs the copy does not declare (the function's default applies: KFP passes a function only the
    inputs its task has)."""
    copy = deepcopy(component)
    copy.component_spec.name = name
    copy.name = name
    for input_name in drop or []:
        if not copy.component_spec.inputs[input_name].optional:
            raise ValueError(f"{name}: input {input_name} is not optional")
        del copy.component_spec.inputs[input_name]
    return copy
