"""The DAG's shape, written once: routes, stages, who reads whom, task names and output keys.

Plain data tables and small functions over them, read by the DAG (pipelines/dag.py), kfp.local's runner
and `kubealign rerun` (pipelines/local.py, pipelines/rerun.py), the run summary (kubealign/cli/summary.py), the
CLI's choices and the config's (pipeline.candidates' algorithm). Adding a route or a task touches this module and the
code of that task (its stage, task function and component), nothing else; docs/pipeline.md lists the places.
"""

from __future__ import annotations

# a candidate's route (pipeline.candidates); the rl ones run the ppo task with ppo.algorithm set to the route's
# name, and of those ppo alone trains a critic (has_critic)
ROUTES = ("ppo", "grpo", "rloo", "dpo")
RL_ROUTES = ("ppo", "grpo", "rloo")
SHARED = ("data-split", "sft", "reward")  # upstream of every route (reward: only with a reward model)
# one route's tasks in DAG order; "ppo" stands for the route's training task (route_task)
STAGES = ("data-split", "sft", "reward", "ppo", "evaluate", "promote")
SUMMARY_STAGES = (
    "feedback",
    "settle",
    "data-split",
    "sft",
    "reward",
    "ppo",
    "dpo",
    "evaluate",
    "promote",
    "serve",
    "judge",
    "act",
)  # all a run may hold
SERVE = "serve"  # after promote, with serve.enabled (one route): the alias as a KServe InferenceService
# after serve, with promote.mode canary too: the canary judged online (runs the reward functions), its verdict
# written (verdict.json); nothing moved
JUDGE = "judge"
# before data-split, with feedback.project: people's choices pulled from Label Studio, one more source of data-split
FEEDBACK = "feedback"
# after judge, with canary.act too: the verdict carried out (registry aliases, then the InferenceService); no
# user code, so it alone gets the pipeline identity (kubealign.cluster.secrets)
ACT = "act"
# after feedback and before promote, with canary.await_people: the canary the previous run left waiting for people,
# decided on their choices and carried out as act does (the pipeline identity; kubealign.stages.settle)
SETTLE = "settle"
# stage -> the stages whose outputs it reads. "candidate": the route's training task (ppo or dpo);
# "scorer": the reward model, or with reward functions alone the SFT model (the critic's start; not read
# by evaluate then).
UPSTREAM = {
    "data-split": ("feedback",),  # read only where the run has a feedback task
    "sft": ("data-split",),
    "reward": ("data-split",),
    "ppo": ("data-split", "sft", "scorer"),
    "dpo": ("data-split", "sft"),
    "evaluate": ("data-split", "sft", "scorer", "candidate"),
    "promote": ("evaluate", "candidate"),
    "serve": ("promote",),
    "judge": ("data-split", "sft", "scorer", "serve"),
    "act": ("judge",),  # the verdict names the version and the InferenceService
    "settle": (),  # reads the registry and MLflow, no task's directory
}
# The KFP output each task's directory is in: shared tasks by name; a several-route run's route tasks are
# named after their route (grpo, evaluate-grpo, promote-grpo) and found by prefix.
OUTPUT_KEYS = {
    "feedback": "dataset",
    "data-split": "dataset",
    "sft": "model",
    "reward": "model",
    "compare": "comparison",
    "serve": "serving",
    "judge": "judgement",
    "act": "acted",
    "settle": "settled",
}
ROUTE_TASK_KEYS = (("", "model"), ("evaluate-", "evaluation"), ("promote-", "promotion"))
# With pipeline.parallelism, the candidates past the first `parallelism` each wait for a slot: a no-op task
# wait-NAME that runs once an earlier candidate's branch has ended (kubealign.pipelines.sweep).
WAIT_PREFIX = "wait-"
# names a candidate may not take: the DAG's own tasks (candidates.check_names also refuses the prefixes)
RESERVED_TASKS = (*SHARED, FEEDBACK, "compare", SERVE, JUDGE, ACT, SETTLE, "evaluate", "promote", "wait")


def route_task(route: str) -> str:
    """The task that trains the route's candidate: dpo for the dpo route, ppo for ppo, grpo and rloo."""
    return "dpo" if route == "dpo" else "ppo"


def has_critic(route: str) -> bool:
    """Whether the route trains a critic (a value model, advantages by GAE): ppo. grpo and rloo are critic-free
    (their baseline is the other responses to the same prompt), and so is dpo (no rollouts at all)."""
    return route == "ppo"


def scorer(reward_model: bool) -> str:
    """The task whose model scores (and starts ppo's critic): the reward model, else the SFT model."""
    return "reward" if reward_model else "sft"


def stages_for(
    route: str,
    reward_model: bool = True,
    serve: bool = False,
    judge: bool = False,
    act: bool = False,
    feedback: bool = False,
) -> tuple[str, ...]:
    """The tasks a one-route run executes, in DAG order (no reward task when reward functions alone score;
    serve after promote with serve.enabled, judge after serve with promote.mode canary as well, act after judge
    with canary.act as well; feedback first with feedback.project)."""
    kept = (s for s in STAGES if reward_model or s != "reward")
    judged = (JUDGE, *((ACT,) if act else ())) if judge else ()
    served = (SERVE, *judged) if serve else ()
    first = (FEEDBACK,) if feedback else ()
    return (*first, *(route_task(route) if stage == "ppo" else stage for stage in kept), *served)


def tasks_for_routes(
    names: list[str] | tuple[str, ...],
    reward_model: bool,
    serve: bool = False,
    judge: bool = False,
    parallelism: int = 0,
    act: bool = False,
    feedback: bool = False,
) -> tuple[str, ...]:
    """The tasks a run executes, in DAG order: with one candidate (`names`: its route alone), stages_for its
    route; with several (`names`: the candidates' names), the shared tasks, each candidate's wait (with
    pipeline.parallelism, past the first `parallelism`), training and evaluation, the comparison, each
    candidate's promotion."""
    if len(names) == 1:
        return stages_for(names[0], reward_model, serve, judge, act, feedback)
    shared = ((FEEDBACK,) if feedback else ()) + tuple(s for s in SHARED if reward_model or s != "reward")
    waits = set(names[parallelism:]) if parallelism else set()
    trained = tuple(
        task
        for name in names
        for task in ((f"{WAIT_PREFIX}{name}",) if name in waits else ()) + (name, f"evaluate-{name}")
    )
    return (*shared, *trained, "compare", *(f"promote-{name}" for name in names))


def upstream(stage: str, tasks: tuple[str, ...]) -> tuple[str, ...]:
    """The tasks of a one-route run (`tasks`: stages_for's) whose outputs `stage` reads."""
    candidate = next(s for s in tasks if s in ("ppo", "dpo"))
    named = {"candidate": candidate, "scorer": scorer("reward" in tasks)}
    found = (named.get(up, up) for up in UPSTREAM[stage])
    return tuple(dict.fromkeys(up for up in found if up in tasks))


def downstream_of(stage: str, tasks: tuple[str, ...] = STAGES) -> list[str]:
    """Every task that reads `stage`'s output, directly or not, in DAG order."""
    found = {stage}
    for task in tasks:
        if any(up in found for up in upstream(task, tasks)):
            found.add(task)
    return [s for s in tasks if s in found and s != stage]


def output_key(task: str) -> str:
    """The name of the output that holds `task`'s directory in a several-route run."""
    if task in OUTPUT_KEYS:
        return OUTPUT_KEYS[task]
    return next(key for prefix, key in reversed(ROUTE_TASK_KEYS) if task.startswith(prefix))


def is_wait(task: str) -> bool:
    """A candidate's wait for a slot (pipeline.parallelism): no output, nothing to index."""
    return task.startswith(WAIT_PREFIX)


def route_of(task: str) -> str | None:
    """The candidate (its name; a candidate without one is named after its route) a task of a several-candidate
    run belongs to (None: a shared task or the comparison)."""
    if task in OUTPUT_KEYS:
        return None
    if task.startswith(WAIT_PREFIX):
        return task.removeprefix(WAIT_PREFIX)
    return next(task.removeprefix(prefix) for prefix, _ in reversed(ROUTE_TASK_KEYS) if task.startswith(prefix))
