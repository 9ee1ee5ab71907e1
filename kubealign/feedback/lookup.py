"""The online judge's people's check (canary.min_human_win_rate): the latest `kubealign feedback
pull` with people's choices on a registered model's version, read from MLflow: the feedback runs tag the registered
model once the registry has vouched for the versions its tasks name (feedback.pull), and log each challenger
version's win-rate, so that feedback about another model's version of the same number never passes the judge of this
one, and a project holding several rounds gives each round's version its own verdict."""

from __future__ import annotations

from typing import Any

VERSION_TAG = "kubealign.feedback.challenger_version"
MODEL_TAG = "kubealign.feedback.registered_model"
# on a feedback run whose judges were checked against people, the registered model all its tasks named (the
# registry vouched for it): what promote.guards.min_judge_agreement looks up (agreement())
AGREEMENT_TAG = "kubealign.feedback.agreement_model"


def latest(tracking_uri: str, experiment: str, model: str, version: str) -> Any:
    """serving.verdict.HumanFeedback of the newest feedback run with people's choices on `model`'s `version` in
    `experiment` (its human_win_rate_version_<version>, decided_version_<version>: a pull of a project that holds
    several rounds has one of each per challenger version); None if none."""
    if not version.isdigit():  # a registry version is a number; anything else names no metric
        return None
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors
    from kubealign.serving.verdict import HumanFeedback

    with registry_errors(tracking_uri):
        client = MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        runs = client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.`{MODEL_TAG}` = '{model}' and metrics.`decided_version_{version}` > 0 "
            "and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
    if not runs:
        return None
    metrics = runs[0].data.metrics
    decided = int(metrics[f"decided_version_{version}"])
    rate = metrics.get(f"human_win_rate_version_{version}", float("nan"))
    return HumanFeedback(rate, decided if rate == rate else 0, f"feedback run {runs[0].info.run_id}")


def agreement(client: Any, experiment_id: str, model: str) -> dict[str, float]:
    """The judges' agreement with people (agreement_<judge>, _n: feedback.agreement.figures) of the newest finished
    feedback run of `model` in the experiment that measured any; {} if none. client: an MlflowClient."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{AGREEMENT_TAG}` = '{model}' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        return {}
    return {k: v for k, v in runs[0].data.metrics.items() if k.startswith("agreement_")}


def people(uri: str | None, config: Any, version: str) -> tuple[Any, dict[str, float]]:
    """What people said that the online judge reads: their verdict on the canary's `version` (latest(); None when
    canary.min_human_win_rate is unset) and the judges' agreement with them (agreement(); {} when
    promote.guards.min_judge_agreement is unset); (None, {}) without a registry."""
    if not uri:
        return None, {}
    model, experiment = config.promote.registered_model, config.tracking.experiment
    human = None if config.canary.min_human_win_rate is None else latest(uri, experiment, model, version)
    if config.promote.guards.min_judge_agreement is None:
        return human, {}
    from mlflow.tracking import MlflowClient

    from kubealign.promotion.aliases import registry_errors

    with registry_errors(uri):
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        return human, {} if found is None else agreement(client, found.experiment_id, model)
