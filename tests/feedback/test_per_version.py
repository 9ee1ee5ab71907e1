"""People's verdict per version (issue 79): a project holding several rounds holds several challenger versions, so a
pull logs each version's own win-rate (weighted as the push chose the pairs) and the online judge's people's check
reads its canary's, not the mixture. By hand, and through a real MLflow store."""

from __future__ import annotations

import pytest

from kubealign.feedback import agreement, lookup

pytestmark = pytest.mark.unit


def decided(first: str, second: str, chose: str, weight=None) -> tuple[dict, str]:
    meta = {"answer1": first, "answer2": second}
    if weight is not None:
        meta["weight"] = weight
    return meta, chose


def test_each_challenger_version_has_its_own_weighted_win_rate():
    tasks = [
        decided("champion:1", "challenger:2", "answer2", 1.0),  # version 2 wins, weight 1
        decided("challenger:2", "champion:1", "answer2", 3.0),  # version 2 loses, weight 3 (a random pair)
        decided("challenger:10", "champion:2", "answer1"),  # no weight (a plain push): 1
        decided("challenger:3", "champion:2", "answer2", 2.0),
        decided("challenger:3", "champion:2", "answer1", 0),  # a weight that is no weight: 1
        decided("champion:1", "champion:2", "answer1", 1.0),  # no challenger side: no version's
        decided("challenger:4", "challenger:5", "answer1", 1.0),  # both sides the alias: whose is unknown
    ]
    found = agreement.by_version(tasks, "challenger")
    assert found == {"2": (pytest.approx(0.25), 2), "3": (pytest.approx(1 / 3), 2), "10": (1.0, 1)}
    assert list(found) == ["2", "3", "10"]  # by number
    assert agreement.by_version([], "challenger") == {}


def test_the_people_check_reads_its_own_versions_figures(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("rounds")

    def pull_run(model: str, figures: dict[str, float]) -> str:
        run = client.create_run(experiment, tags={lookup.MODEL_TAG: model})
        for key, value in figures.items():
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
        return run.info.run_id

    older = pull_run("actor", {"decided_version_2": 4, "human_win_rate_version_2": 0.25})
    newer = pull_run("actor", {"decided_version_2": 6, "human_win_rate_version_2": 0.5, "decided_version_3": 5,
                                "human_win_rate_version_3": 0.8})  # fmt: skip
    pull_run("critic", {"decided_version_4": 9, "human_win_rate_version_4": 0.9})
    three = lookup.latest(uri, "rounds", "actor", "3")
    assert (three.win_rate, three.decided, three.source) == (0.8, 5, f"feedback run {newer}")
    two = lookup.latest(uri, "rounds", "actor", "2")  # the newest run with people's choices on it
    assert (two.win_rate, two.decided) == (0.5, 6) and older not in two.source
    assert lookup.latest(uri, "rounds", "actor", "4") is None  # another model's version 4
    assert lookup.latest(uri, "rounds", "actor", "1") is None  # nobody decided on it
    # no number names no metric: not even one that would rewrite the filter into version 2's
    assert lookup.latest(uri, "rounds", "actor", "9` > 0 or metrics.`decided_version_2") is None
    assert lookup.latest(uri, "elsewhere", "actor", "3") is None


def test_a_pull_of_two_rounds_gives_each_version_its_verdict(cli, tmp_path, monkeypatch):
    """Rounds 1 and 2 in one project (challengers 4 and 5): the pull's run names the registered model, not one
    version, and the judge's check of version 5 reads version 5's tasks alone."""
    from kubealign.feedback import served
    from kubealign.feedback.client import LabelStudio
    from kubealign.feedback.pairs import LABEL_CONFIG
    from tests.feedback.standin import LabelStudioStandIn, annotate
    from tests.feedback.test_client import registry_holding
    from tests.feedback.test_served import judge_dir

    registry = registry_holding(tmp_path, 5)
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "t")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry)
    with LabelStudioStandIn("t") as ls:
        LabelStudio(ls.url, "t").create_project("prefs", LABEL_CONFIG)
        for number, canary in ((1, "4"), (2, "5")):
            judged = judge_dir(tmp_path / f"r{number}", versions={"champion": "3", "canary": canary})
            got = served.served_tasks(judged, "kubealign-actor", 4, 0.0, seed=1, round_number=number)
            ls.store.add_tasks(1, got.tasks)
        # the canary's answers are k0, k1, ...: round 1's person prefers the champion's, round 2's the canary's
        tasks = ls.store.projects[1]["tasks"]
        annotate(tasks[:4], lambda p, t: t.startswith("c"), noise=0.0, skip=0.0, seed=0)
        annotate(tasks[4:], lambda p, t: t.startswith("k"), noise=0.0, skip=0.0, seed=0)
        done = cli("feedback", "pull", "--project", "prefs", "--output", tmp_path / "people.jsonl", "--url", ls.url)
    assert done.code == 0, done.err
    from mlflow import MlflowClient

    (run,) = MlflowClient(registry).search_runs([e.experiment_id for e in MlflowClient(registry).search_experiments()])
    assert run.data.tags[lookup.MODEL_TAG] == "kubealign-actor" and lookup.VERSION_TAG not in run.data.tags
    four = lookup.latest(registry, "kubealign-tiny", "kubealign-actor", "4")
    five = lookup.latest(registry, "kubealign-tiny", "kubealign-actor", "5")
    assert (four.win_rate, four.decided, five.win_rate, five.decided) == (0.0, 4, 1.0, 4)
    assert run.data.metrics["human_win_rate"] == 0.5  # the mixture the check no longer reads
