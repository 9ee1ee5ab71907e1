"""The kubealign DAG: data-split -> sft || reward -> (ppo | dpo) -> evaluate -> promote [-> serve [-> judge [-> act]]],
with a feedback task before data-split where feedback.project is set (people's choices pulled from Label Studio),
and then a push task after judge and act: what the canary served, to people. The feedback task's output is the run's
config with its round counted from the project (kubealign.feedback.rounds): every later task reads that one. With
canary.await_people a settle task follows the feedback task and comes before promote: the canary the previous run's
judge left waiting for people, decided on their choices (kubealign.stages.settle).

The pipeline parameter `algorithm` (default: the route of the config's one candidate) picks the route with KFP
conditions, all in one compiled pipeline: `ppo`, `grpo` or `rloo` run the ppo task with ppo.algorithm set
to it; `dpo` runs the dpo task on the phase-2 pairs from the SFT model. Evaluate and promote take the one
candidate the route produced (dsl.OneOf), and promote tags the registered version with its algorithm.

`build(config)` returns the @dsl.pipeline function for one resolved config. The config becomes the
pipeline parameter `config_json` (editable in the Kubeflow UI), next to the common knobs:

| pipeline parameter   | config field            | task(s)                       |
|----------------------|-------------------------|-------------------------------|
| config_json          | the whole config        | all                           |
| sft_model            | sft.model               | sft                           |
| reward_model         | reward.model            | reward                        |
| algorithm            | pipeline.candidates     | which of ppo / dpo runs; ppo.algorithm |
| ppo_num_iterations   | ppo.num_iterations      | ppo                           |
| reward_functions     | rewards.functions, with each FILE.py's source embedded | ppo, evaluate (cache key) |
| data_fingerprint     | (sources' content hash) | data_split (cache key only)   |
| sft_model_fingerprint / reward_model_fingerprint | (base models' hashes) | sft / reward (cache key only) |

evaluate also takes a constant input, `suites_fingerprint`: the sha256 of evaluate.suites' include_path files
(and allow_code), fixed when the pipeline is compiled (no run parameter can change it), in evaluate's cache key
and checked by the task against the files it reads (kubealign.answers.suites.fingerprint).

Reward functions (rewards.functions) travel inside the compiled pipeline: the parameter reward_functions
holds their specs with each FILE.py function's source, read when the pipeline is built, so the image need
not carry them and editing one changes the cache key of exactly the tasks that score with it (ppo and
evaluate; promote is never cached). With functions alone (rewards.model_weight 0) there is no reward task:
ppo's critic starts from the SFT model and evaluate's reward_model input is the SFT model, not read; the
pipeline's outputs then have no `reward`.

Everything about the cluster is set here, from `config.kubernetes`, never in the components: GPUs per
stage, CPU/memory requests, /dev/shm as a memory emptyDir on training pods, MLflow and object-store
credentials from Secrets (the pods that run the reward functions, the online judge's included, get the
tracking identity and no object store; the act task that carries the judge's verdict out gets the pipeline
identity: kubealign.cluster.secrets), an optional PVC, node selectors and tolerations. The promotion gate is inside
the promote task (it always registers a challenger; only a candidate that passes moves @champion).
"""

# No `from __future__ import annotations` here: KFP reads the pipeline function's annotations as objects.
import json
from collections.abc import Callable
from typing import Any, NamedTuple

from kfp import dsl, kubernetes
from kfp.dsl import Artifact, Dataset, Model

from kubealign import pod, tasks
from kubealign.components import stages
from kubealign.config import KubealignConfig, config_to_json
from kubealign.config.schema import KubernetesConfig, PipelineConfig
from kubealign.feedback.client import TOKEN_ENV, URL_ENV
from kubealign.images import cpu_image, train_image
from kubealign.models import hub
from kubealign.pipelines import placement, sweep
from kubealign.pipelines.fingerprint import data_fingerprint, model_fingerprint, suites_fingerprint
from kubealign.pipelines.sweep import RoutesFunctionOutputs, RoutesOutputs
from kubealign.shape import scorer as scorer_task
from kubealign.stages import serve as serve_stage
from kubealign.tracking.runs import check_uri
from kubealign.usercode import definitions

PIPELINE_NAME = "kubealign-rlhf"
DAG_ONLY = ("retries", "retry_backoff", "retry_backoff_max", "queue")  # kubernetes.* no task reads


class Outputs(NamedTuple):
    """What a pipeline run returns: each stage's output directory (kfp.local hands them to `kubealign run`);
    `candidate` is the ppo task's or the dpo task's model, whichever the route ran."""

    data_split: Dataset
    sft: Model
    reward: Model
    candidate: Model
    evaluate: Artifact
    promote: Artifact


class FunctionOutputs(NamedTuple):
    """Outputs of a pipeline scored by reward functions alone: no reward task."""

    data_split: Dataset
    sft: Model
    candidate: Model
    evaluate: Artifact
    promote: Artifact


def pipeline_defaults(config: KubealignConfig) -> dict[str, Any]:
    """The pipeline parameters' defaults: config_json without what varies per route or only this module
    reads, so runs of different routes (and retry / queue settings) share the tasks before the branch (KFP's
    cache keys); the route itself is the `algorithm` parameter."""
    config = hub.pin(config)  # hub models as the commits they name now: what every task loads, the cache key
    scheduling = {key: KubernetesConfig.model_fields[key].default for key in DAG_ONLY}
    shared = config.model_copy(
        update={
            "pipeline": PipelineConfig(),
            "ppo": config.ppo.model_copy(update={"algorithm": "ppo"}),
            "kubernetes": config.kubernetes.model_copy(update=scheduling),
        }
    )
    return {
        "config_json": config_to_json(shared),
        "algorithm": config.route(),
        "sft_model": config.sft.model,
        "reward_model": config.reward.model,
        "ppo_num_iterations": config.ppo.num_iterations,
        "data_fingerprint": data_fingerprint(config),
        "sft_model_fingerprint": model_fingerprint(config.sft.model, config.sft.revision),
        "reward_model_fingerprint": model_fingerprint(config.reward.model, config.reward.revision),
        "reward_functions": definitions.to_json(definitions.resolve_all(config.rewards, config.tools, config.base_dir)),
    }


class Tasks:
    """Makes the DAG's tasks and places them on the cluster (config.kubernetes, `env` on every task)."""

    def __init__(
        self,
        config: KubealignConfig,
        env: dict[str, str] | None,
        functions_json: str,
        settings: dict[str, str] | None = None,
    ):
        """settings: a one-candidate run's `settings` input of its training task (build)."""
        self.config, self.k8s = config, config.kubernetes
        pins = tasks.pins(config, functions_json)  # what a run cannot edit
        # the functions' sha256 only on the tasks that read them (it changes with them, and kfp.local's cache
        # key includes a task's environment): every other task stays cached when a function is edited
        self.scoring_env = {pod.FUNCTIONS_SHA_ENV: pins.pop(pod.FUNCTIONS_SHA_ENV)}
        self.env = {**(env or {}), **pins}
        # the user's suites' files, a constant input of evaluate: its cache key, and what the task checks
        self.suites = suites_fingerprint(config)
        self.train_image = self.k8s.train_image or train_image()
        self.cpu_image = self.k8s.cpu_image or cpu_image()
        self.with_model = config.rewards.uses_model
        self.settings = settings or {}
        self.settled: dsl.PipelineTask | None = None  # the settle task, once data() made it (canary.await_people)

    def place(
        self,
        task: dsl.PipelineTask,
        name: str,
        gpus: int,
        training: bool,
        scoring: bool = False,
        tracking_only: bool = False,
        identity: bool = True,
    ) -> dsl.PipelineTask:
        """scoring: the task reads the reward functions (ppo's, evaluate, judge), so it runs user code and gets
        the tracking identity (kubealign.cluster.secrets); tracking_only: it gets that identity too (it only
        logs runs: feedback); identity False: no MLflow or object-store Secret at all (push)."""
        task.set_display_name(name)
        image = self.train_image if training or gpus else self.cpu_image
        user_code = scoring or tracking_only
        placement.resources(task, self.k8s, gpus, image, training, user_code=user_code, identity=identity)
        for key, value in sorted({**self.env, **(self.scoring_env if scoring else {})}.items()):
            task.set_env_variable(key, value)
        return task

    def data(self, p: dict[str, Any]) -> Any:
        """The data-split task's dataset; with feedback.project, after a feedback task whose pulled choices it
        reads as one more source."""
        people = {}
        if self.config.feedback.project:
            pulled = stages.feedback(config_json=p["config_json"])
            # it logs a feedback run: the tracking identity, no object store (nothing it does moves an alias)
            self.place(pulled, "feedback (Label Studio)", 0, training=False, tracking_only=True)
            self.label_studio(pulled)
            # the project changes outside KFP's view: a cached pull would miss every choice made since
            pulled.set_caching_options(False)
            people = {"feedback": pulled.outputs["dataset"]}
            # every later task reads the run's config as the pull counted its round (a scheduled run's own round)
            p["config_json"] = pulled.outputs["Output"]
        c = self.config  # a canary judged online and acted on, its verdict held for people: settled first
        if c.canary.await_people and c.serve.enabled and c.promote.mode == "canary" and c.canary.act:
            self.settled = self.settle(p["config_json"])
        split = stages.data_split(config_json=p["config_json"], data_fingerprint=p["data_fingerprint"], **people)
        return self.place(split, "data split", 0, training=False).outputs["dataset"]

    def settle(self, config_json: Any) -> dsl.PipelineTask:
        """After the feedback task (canary.await_people): the canary the previous run held for people, decided on
        their choices and carried out as the pipeline identity (no user code); promote waits for it."""
        task = stages.settle(config_json=config_json)
        self.place(task, "settle (the waiting canary)", 0, training=False)
        # the registry, MLflow and the cluster are outside KFP's view: a cached settle would decide nothing
        task.set_caching_options(False)
        return task

    def label_studio(self, task: dsl.PipelineTask) -> None:
        """The token from feedback.token_secret; where it goes pinned here, not read from config_json, which any run
        may edit: a run cannot send the token to another address (the stages prefer this variable to feedback.url)."""
        kubernetes.use_secret_as_env(task, self.config.feedback.token_secret, {TOKEN_ENV: TOKEN_ENV})
        task.set_env_variable(URL_ENV, self.config.feedback.url)

    def push(self, judge: dsl.PipelineTask, after: dsl.PipelineTask | None, config_json: Any) -> dsl.PipelineTask:
        """After judge (and act): the pairs the canary served, to people (feedback.project); no user code runs here,
        no tracking identity."""
        task = stages.push(config_json=config_json, judgement=judge.outputs["judgement"])
        if after is not None:
            task.after(after)
        self.place(task, "push (served pairs to people)", 0, training=False, identity=False)
        self.label_studio(task)
        # Label Studio is outside KFP's view: a cached push would send nothing
        task.set_caching_options(False)
        return task

    def upstream(self, p: dict[str, Any]) -> tuple[Any, Any, Any]:
        """The shared tasks: (dataset, SFT model, scorer: kubealign.shape.scorer's task's model)."""
        dataset = self.data(p)
        sft = stages.sft(
            config_json=p["config_json"],
            model_name=p["sft_model"],
            model_fingerprint=p["sft_model_fingerprint"],
            data=dataset,
        )
        self.place(sft, "supervised fine-tuning", self.k8s.sft_gpus, training=True)
        models = {"sft": sft.outputs["model"]}
        if self.with_model:
            reward = stages.reward(
                config_json=p["config_json"],
                model_name=p["reward_model"],
                model_fingerprint=p["reward_model_fingerprint"],
                data=dataset,
            )
            models["reward"] = self.place(reward, "reward model", self.k8s.reward_gpus, training=True).outputs["model"]
        return dataset, models["sft"], models[scorer_task(self.with_model)]

    def dpo(
        self, component: Any, p: dict[str, Any], dataset: Any, sft: Any, label: str = "DPO", **settings: str
    ) -> dsl.PipelineTask:
        """settings: a candidate's (`settings=` its JSON), only in a several-candidate DAG."""
        task = component(config_json=p["config_json"], data=dataset, actor=sft, **settings)
        return self.place(task, label, self.k8s.sft_gpus, training=True)

    def rl(
        self,
        component: Any,
        p: dict[str, Any],
        algorithm: Any,
        dataset: Any,
        sft: Any,
        scorer: Any,
        label: str,
        **settings: str,
    ) -> dsl.PipelineTask:
        """settings: a candidate's (`settings=` its JSON), only in a several-candidate DAG."""
        task = component(
            config_json=p["config_json"],
            algorithm=algorithm,
            num_iterations=p["ppo_num_iterations"],
            reward_functions=p["reward_functions"],
            prompts=dataset,
            actor=sft,
            critic=scorer,
            **settings,
        )
        return self.place(task, label, self.k8s.ppo_gpus, training=True, scoring=True)

    def evaluate(
        self, component: Any, p: dict[str, Any], dataset: Any, sft: Any, candidate: Any, scorer: Any
    ) -> dsl.PipelineTask:
        evaluation = component(
            config_json=p["config_json"],
            reward_functions=p["reward_functions"],
            prompts=dataset,
            baseline=sft,
            candidate=candidate,
            reward_model=scorer,
            suites_fingerprint=self.suites,
        )
        return self.place(evaluation, "evaluate", self.k8s.evaluate_gpus, training=False, scoring=True)

    def serve(self, promote: dsl.PipelineTask, config_json: Any) -> dsl.PipelineTask:
        """After promote (serve.enabled): the alias as a KServe InferenceService in the pod's own namespace."""
        task = stages.serve(config_json=config_json, promotion=promote.outputs["promotion"])
        self.place(task, "serve (KServe InferenceService)", 0, training=False)
        kubernetes.use_field_path_as_env(task, serve_stage.NAMESPACE_ENV, "metadata.namespace")
        kubernetes.use_field_path_as_env(task, pod.RUN_ID_ENV, "metadata.labels['pipeline/runid']")
        # the cluster is outside KFP's view, like the registry: a cached serve would not apply anything
        task.set_caching_options(False)
        return task

    def judge(
        self, serve: dsl.PipelineTask, p: dict[str, Any], dataset: Any, sft: Any, scorer: Any
    ) -> dsl.PipelineTask:
        """After serve (promote.mode canary): the canary judged online by its pods, its verdict written; it runs
        the reward functions, so it moves nothing (the act task does)."""
        serving = serve.outputs["serving"]
        task = stages.judge(
            config_json=p["config_json"], prompts=dataset, tokenizer=sft, reward_model=scorer, serving=serving
        )
        self.place(task, "judge (the canary online)", 0, training=False, scoring=True)
        # the served models and the registry are outside KFP's view: a cached verdict would judge nothing
        task.set_caching_options(False)
        return task

    def act(self, judge: dsl.PipelineTask, config_json: Any) -> dsl.PipelineTask:
        """After judge (canary.act): its verdict carried out, the registry's aliases then the InferenceService,
        as the pipeline identity (no user code runs here)."""
        task = stages.act(config_json=config_json, judgement=judge.outputs["judgement"])
        self.place(task, "act (the verdict carried out)", 0, training=False)
        # the registry and the cluster are outside KFP's view: a cached act would carry nothing out
        task.set_caching_options(False)
        return task

    def promote(self, task: dsl.PipelineTask, label: str) -> dsl.PipelineTask:
        self.place(task, label, 0, training=False)
        # The registry is outside KFP's view: re-registering is idempotent, but a cached promote would
        # skip the gate against a champion that may have changed since.
        task.set_caching_options(False)
        return task


def _one_route(builder: Tasks, d: dict[str, Any]) -> Callable[..., Any]:
    """The pipeline of one route, chosen by the `algorithm` parameter with KFP conditions."""

    def kubealign_pipeline(
        config_json: str = d["config_json"],
        algorithm: str = d["algorithm"],
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
        # a one-candidate run's settings go to the branch of its route's section only
        dpo_settings = builder.settings if builder.config.route() == "dpo" else {}
        rl_settings = {} if builder.config.route() == "dpo" else builder.settings
        with dsl.If(algorithm == "dpo", name="dpo route"):
            dpo = builder.dpo(stages.dpo, p, dataset, sft, **dpo_settings)
        with dsl.Else(name="rl route"):
            label = "PPO / GRPO / RLOO (hybrid engine)"
            ppo = builder.rl(stages.ppo, p, algorithm, dataset, sft, scorer, label, **rl_settings)
        candidate = dsl.OneOf(dpo.outputs["model"], ppo.outputs["model"])
        evaluation = builder.evaluate(stages.evaluate, p, dataset, sft, candidate, scorer)
        config_json = p["config_json"]  # the feedback task's, with feedback.project (Tasks.data)
        promote = stages.promote(
            config_json=config_json, evaluation=evaluation.outputs["evaluation"], candidate=candidate
        )
        builder.promote(promote, "promote (MLflow registry)")
        if builder.settled is not None:  # the waiting canary decided first: promote gates against that champion
            promote.after(builder.settled)
        if builder.config.serve.enabled:
            serve = builder.serve(promote, config_json)
            if builder.config.promote.mode == "canary":
                judge = builder.judge(serve, p, dataset, sft, scorer)
                act = builder.act(judge, config_json) if builder.config.canary.act else None
                if builder.config.feedback.project:
                    builder.push(judge, act, config_json)
        done = {
            "data_split": dataset,
            "sft": sft,
            "candidate": candidate,
            "evaluate": evaluation.outputs["evaluation"],
            "promote": promote.outputs["promotion"],
        }
        return Outputs(reward=scorer, **done) if builder.with_model else FunctionOutputs(**done)

    return kubealign_pipeline


def build(config: KubealignConfig, env: dict[str, str] | None = None) -> Callable[..., None]:
    """The pipeline function for `config`; `env` is set on every task (e.g. the MLflow parent run).
    One candidate (pipeline.candidates, or none: ppo.algorithm's route): its route is the `algorithm`
    parameter. Several: a branch per candidate (kubealign.pipelines.sweep)."""
    check_uri(config.tracking.uri, "tracking.uri")  # config_json is in the compiled pipeline, readable by all
    several = config.several()
    settings: dict[str, str] = {}
    if not several and config.pipeline.candidates:
        # one candidate: the one-route DAG of its route, its settings an input of its training task alone (as
        # in a sweep), so the shared tasks keep the cache key of any run of the same config
        only = config.candidates()[0]
        config = config.for_candidate(only._replace(settings={}))
        settings = {"settings": json.dumps(dict(only.settings), sort_keys=True)} if only.settings else {}
    defaults = pipeline_defaults(config)
    builder = Tasks(config, env, defaults["reward_functions"], settings)
    function = (sweep.several_candidates if several else _one_route)(builder, defaults)
    # KFP reads the outputs from the return annotation: with no reward task there is no `reward` output.
    outputs = {(False, True): Outputs, (False, False): FunctionOutputs}
    outputs.update({(True, True): RoutesOutputs, (True, False): RoutesFunctionOutputs})
    function.__annotations__["return"] = outputs[several, builder.with_model]
    function.__name__ = "kubealign_pipeline"
    return dsl.pipeline(
        name=PIPELINE_NAME,
        description="RLHF: data split, SFT, reward model and / or reward functions, PPO (DeepSpeed Hybrid Engine), "
        "evaluation, MLflow registry promotion."
        + (f" Candidates compared in one run: {', '.join(config.candidate_names())}." if several else ""),
    )(function)
