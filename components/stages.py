"""The stage components. Each body imports kubealign inside the function: KFP ships only the
function's source to the pod, where the image provides the package.

Parameters shared by all: `config_json` (the resolved config, canonical JSON) and, per stage, the
pipeline's common knobs, passed on as `--set`-style overrides.
"""

from kfp import dsl
from kfp.dsl import HTML, Artifact, ClassificationMetrics, Dataset, Input, Markdown, Metrics, Model, Output

from kubealign.images import CPU_IMAGE, TRAIN_IMAGE


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def feedback(config_json: str, dataset: Output[Dataset], metrics: Output[Metrics], rounds: Output[HTML]) -> str:
    """feedback: people's completed pairwise choices in the Label Studio project feedback.project, pulled as
    preference rows for data-split (with a `feedback` MLflow run: the counts, the human win-rate); rounds: the
    picture across rounds (people's win-rate of each round's challenger, each judge's agreement with people).

    Returns the run's config: config_json with feedback.round counted from the project (kubealign.feedback.rounds),
    what every later task of the run reads."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.feedback(config_json, dataset.path)
    artifacts.to_kfp(result, metrics, dataset)
    artifacts.rounds_report(dataset.path, rounds.path)
    return result["config_json"]


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def data_split(
    config_json: str,
    data_fingerprint: str,
    dataset: Output[Dataset],
    metrics: Output[Metrics],
    feedback: Input[Dataset] = None,
):
    """data-split: normalize, validate, deduplicate and split the sources into the three phases.

    data_fingerprint (the sources' content hash, computed at compile time) is not read: it is an input
    so that KFP's cache key changes whenever the data does. feedback (only with feedback.project): the
    feedback task's output, whose rows join the sources.
    """
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.data_split(config_json, [], dataset.path, feedback.path if feedback is not None else None)
    artifacts.to_kfp(result, metrics, dataset)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def sft(
    config_json: str,
    model_name: str,
    model_fingerprint: str,
    data: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
):
    """sft: supervised fine-tuning of model_name on phase 1 (DeepSpeed; torchrun on a multi-GPU pod).

    model_fingerprint (content hash of a local base model dir) is only part of the cache key."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.train("sft", config_json, [], data.path, model_name, model.path)
    artifacts.to_kfp(result, metrics, model)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def reward(
    config_json: str,
    model_name: str,
    model_fingerprint: str,
    data: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    roc: Output[ClassificationMetrics],
):
    """reward: Bradley-Terry reward model on phase 2; ROC and pairwise confusion matrix for the UI."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.train("reward", config_json, [], data.path, model_name, model.path)
    artifacts.to_kfp(result, metrics, model)
    fpr, tpr, thresholds, matrix = artifacts.roc(model.path)
    roc.log_roc_curve(fpr, tpr, thresholds)
    roc.log_confusion_matrix(["rejected", "chosen"], matrix)
    artifacts.persist(roc)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def ppo(
    config_json: str,
    algorithm: str,
    num_iterations: int,
    reward_functions: str,
    prompts: Input[Dataset],
    actor: Input[Model],
    critic: Input[Model],
    model: Output[Model],
    metrics: Output[Metrics],
    settings: str = "{}",
):
    """ppo: PPO, GRPO or RLOO (`algorithm`) with the DeepSpeed Hybrid Engine; torchrun on a multi-GPU pod, a
    TrainJob on several nodes. `critic` is the reward model (critic start and reward), or with reward functions
    alone the SFT model (ppo's critic start); GRPO and RLOO use no critic. reward_functions: the functions'
    specs with their source (embedded at compile time; part of this task's cache key). settings: a
    candidate's own ppo settings, a JSON object of dotted keys ({"ppo.kl_coef": 0.05}; part of its cache key)."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    overrides = [f"ppo.algorithm={algorithm}", f"ppo.num_iterations={num_iterations}"]
    overrides += tasks.setting_overrides(settings)
    result = tasks.ppo(config_json, overrides, prompts.path, actor.path, critic.path, model.path, reward_functions)
    artifacts.to_kfp(result, metrics, model)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def dpo(
    config_json: str,
    data: Input[Dataset],
    actor: Input[Model],
    model: Output[Model],
    metrics: Output[Metrics],
    settings: str = "{}",
):
    """dpo: Direct Preference Optimization of the SFT model (actor) on the phase-2 pairs, against its frozen copy.
    settings: a candidate's own dpo settings, a JSON object of dotted keys ({"dpo.beta": 0.05})."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.train("dpo", config_json, tasks.setting_overrides(settings), data.path, actor.path, model.path)
    artifacts.to_kfp(result, metrics, model)


@dsl.component(base_image=TRAIN_IMAGE, install_kfp_package=False)
def evaluate(
    config_json: str,
    reward_functions: str,
    prompts: Input[Dataset],
    baseline: Input[Model],
    candidate: Input[Model],
    reward_model: Input[Model],
    evaluation: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
    samples: Output[Markdown],
    suites_fingerprint: str = "",
):
    """evaluate: PPO candidate vs SFT baseline on held-out prompts; report = samples + plots in one page.
    reward_model is not read when the reward functions alone score (the DAG then passes the SFT model).
    suites_fingerprint: the sha256 of evaluate.suites' include_path files compiled into the pipeline."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.evaluate(
        config_json,
        [],
        prompts.path,
        baseline.path,
        candidate.path,
        reward_model.path,
        evaluation.path,
        reward_functions,
        suites_fingerprint,
    )
    artifacts.to_kfp(result, metrics, evaluation)
    artifacts.write_report(evaluation.path, report.path, samples.path)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def promote(
    config_json: str,
    evaluation: Input[Artifact],
    candidate: Input[Model],
    promotion: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """promote: register the candidate in the MLflow registry; the gate decides its aliases.

    Returns the aliases the new version holds, e.g. "challenger" or "challenger,champion"."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.promote(config_json, [], evaluation.path, candidate.path, promotion.path)
    artifacts.to_kfp(result, metrics, promotion)
    return artifacts.held_aliases(result)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def serve(config_json: str, promotion: Input[Artifact], serving: Output[Artifact], metrics: Output[Metrics]) -> str:
    """serve: the InferenceService of serve.alias (champion) when promote moved it, applied and Ready.

    Returns its URL, or "" when nothing was applied."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.serve(config_json, [], promotion.path, serving.path)
    artifacts.to_kfp(result, metrics, serving)
    return result.get("url") or ""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def judge(
    config_json: str,
    prompts: Input[Dataset],
    tokenizer: Input[Model],
    reward_model: Input[Model],
    serving: Input[Artifact],
    judgement: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[Markdown],
) -> str:
    """judge: the canary serve put beside the champion, judged online by each predictor's own address (the
    same held-out prompts to both); the verdict written in judgement (verdict.json) for the act task, nothing
    moved. tokenizer: the SFT model; reward_model is not read when reward functions alone score.

    Returns the verdict line, or "" when serve applied no canary."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.judge(config_json, [], prompts.path, tokenizer.path, reward_model.path, serving.path, judgement.path)
    artifacts.to_kfp(result, metrics, judgement)
    artifacts.judge_report(judgement.path, report.path)
    return result.get("verdict") or ""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def act(config_json: str, judgement: Input[Artifact], acted: Output[Artifact], metrics: Output[Metrics]) -> str:
    """act: the judge's verdict (judgement's verdict.json) carried out (canary.act): the registry's aliases
    under promote's lease, then the InferenceService (the champion alone), waiting for Ready. No user code runs
    here: the task of the pipeline identity.

    Returns what it did in one line, or "" when there was nothing to carry out."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.act(config_json, [], judgement.path, acted.path)
    artifacts.to_kfp(result, metrics, acted)
    return result.get("summary") or ""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def settle(config_json: str, settled: Output[Artifact], metrics: Output[Metrics]) -> str:
    """settle (canary.await_people): the canary the previous run's judge left waiting for people, decided on the
    choices the feedback task pulled and carried out as the act task does (the registry's aliases under promote's
    lease, then the InferenceService). No user code runs here: the task of the pipeline identity.

    Returns the verdict line, or why nothing was settled."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.settle(config_json, [], settled.path)
    artifacts.to_kfp(result, metrics, settled)
    return result.get("verdict") or result.get("why") or ""


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def push(config_json: str, judgement: Input[Artifact], pushed: Output[Artifact], metrics: Output[Metrics]):
    """push: the pairs the canary served (judgement's answers.json) to people, as pairwise tasks in the Label
    Studio project feedback.project (feedback.budget of them, the most disputed first); the next round pulls them."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.push(config_json, judgement.path, pushed.path)
    artifacts.to_kfp(result, metrics, pushed)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def compare(
    config_json: str,
    candidates: str,
    comparison: Output[Artifact],
    metrics: Output[Metrics],
    leaderboard: Output[Markdown],
    report: Output[HTML],
    max_kl: float = 0.0,
    evaluation_1: Input[Artifact] = None,
    evaluation_2: Input[Artifact] = None,
    evaluation_3: Input[Artifact] = None,
    evaluation_4: Input[Artifact] = None,
    evaluation_5: Input[Artifact] = None,
    evaluation_6: Input[Artifact] = None,
    evaluation_7: Input[Artifact] = None,
    evaluation_8: Input[Artifact] = None,
    evaluation_9: Input[Artifact] = None,
    evaluation_10: Input[Artifact] = None,
    evaluation_11: Input[Artifact] = None,
    evaluation_12: Input[Artifact] = None,
    evaluation_13: Input[Artifact] = None,
    evaluation_14: Input[Artifact] = None,
    evaluation_15: Input[Artifact] = None,
    evaluation_16: Input[Artifact] = None,
):
    """compare: rank the candidates of one run by their evaluations and draw their reward-KL frontier; a
    leaderboard (Markdown) and the frontier page (HTML) for the UI. candidates: JSON list of {name, route,
    set}; evaluation_N is the N-th candidate's (kubealign.config.candidates.MAX_CANDIDATES of them; the DAG declares
    only its candidates'). max_kl: pipeline.max_kl, 0 = no KL budget. The DAG runs this task even when a
    candidate failed (ignore_upstream_failure): that candidate's evaluation is then absent."""
    import json

    from kubealign import tasks
    from kubealign.tasks import artifacts

    given = dict(locals())
    listed = json.loads(candidates)
    evaluations = {}
    for number, candidate in enumerate(listed, start=1):
        artifact = given.get(f"evaluation_{number}")
        evaluations[candidate["name"]] = None if artifact is None else artifact.path
    result = tasks.compare(config_json, [], listed, evaluations, comparison.path, max_kl)
    artifacts.to_kfp(result, metrics, comparison)
    artifacts.write_leaderboard(comparison.path, leaderboard.path, report.path)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def promote_ranked(
    config_json: str,
    candidate_name: str,
    comparison: Input[Artifact],
    evaluation: Input[Artifact],
    candidate: Input[Model],
    promotion: Output[Artifact],
    metrics: Output[Metrics],
) -> str:
    """promote, one candidate of several: register it tagged with its name, route, settings and rank; only
    the comparison's leader can move the aliases, through the same gate as a one-route run.

    Returns the aliases the new version holds ("" for a candidate that is not the leader)."""
    from kubealign import tasks
    from kubealign.tasks import artifacts

    result = tasks.promote(
        config_json, [], evaluation.path, candidate.path, promotion.path, comparison.path, candidate_name
    )
    artifacts.to_kfp(result, metrics, promotion)
    return artifacts.held_aliases(result)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def wait():
    """wait: a slot for the next candidate (pipeline.parallelism); it runs once an earlier candidate's branch
    has ended, whether that succeeded or failed, and does nothing."""
