"""A canary held for people (canary.await_people): the judge that waits records its figures in MLflow and moves
nothing; the next run's settle task, once people have decided, decides again on those figures with their win-rate
and the judges' latest agreement with them, and carries the verdict out as the act task does.

The registry is sqlite, its versions' files as tests/serving/test_act_boundary.py makes them; the served models are
tests/stages/test_judge.py's stand-in completions servers; the cluster is tests/support/kube_standin.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubealign.config.canary import CanaryConfig
from kubealign.config.schema import PromoteConfig
from kubealign.serving import pending
from kubealign.serving.verdict import HumanFeedback, awaits_people, decide
from kubealign.stages import act as act_task
from kubealign.stages import settle
from tests.serving.test_act_boundary import NAME, aliases, kube, rejected, setup, verdict  # noqa: F401 (fixtures)
from tests.stages.test_judge import Completions, judge_config, listing, online, split  # noqa: F401 (split: fixture)

QUIET = {"error_rate": 0.0, "latency_p95_s": 0.5}
EXPERIMENT = "settle"  # where the judge, the pulls and the settle task log and look
WAITS = [
    f"tracking.experiment={EXPERIMENT}",
    "canary.min_answers=4",
    "canary.min_human_win_rate=0.5",
    "canary.await_people=true",
]


def test_the_verdict_waits_only_for_what_people_alone_can_mend() -> None:
    promote, waits = PromoteConfig(), CanaryConfig(min_answers=8, min_human_win_rate=0.6, await_people=True)
    assert awaits_people(online(0.7, 0.3), 8, QUIET, promote, waits, None)
    assert awaits_people(online(0.7, 0.3), 8, QUIET, promote, waits, HumanFeedback(0.9, 0, "r"))  # none decided
    # people decided (either way): the verdict is theirs now, nothing waits
    assert not awaits_people(online(0.7, 0.3), 8, QUIET, promote, waits, HumanFeedback(0.1, 3, "r"))
    assert not awaits_people(online(0.7, 0.3), 8, QUIET, promote, waits, HumanFeedback(0.9, 1, "r"))
    assert not awaits_people(
        online(0.7, 0.3), 8, QUIET, promote, waits.model_copy(update={"await_people": False}), None
    )
    # what people cannot mend is rolled back at once: a pair short, errors, the gate's own rule
    assert not awaits_people(online(0.7, 0.3), 7, QUIET, promote, waits, None)
    assert not awaits_people(online(0.7, 0.3), 8, {"error_rate": 0.06, "latency_p95_s": 0.5}, promote, waits, None)
    assert not awaits_people(online(0.4, 0.3), 8, QUIET, promote, waits, None)
    assert not awaits_people(None, 0, QUIET, promote, waits, None)
    # every automatic judge distrusted: the gate leans on people, so their approval is all it lacks
    guards = promote.guards.model_copy(update={"min_judge_agreement": 0.6})
    doubted = promote.model_copy(update={"guards": guards})
    figures = {**online(0.7, 0.3), "agreement_reward": 0.3, "agreement_heldout": 0.4}
    assert not decide(figures, 8, QUIET, doubted, waits.model_copy(update={"min_human_win_rate": None}))[0]
    assert awaits_people(figures, 8, QUIET, doubted, waits, None)


def test_the_recorded_figures_split_back_into_what_the_decision_reads() -> None:
    logged = {
        "prompts": 6.0,
        "win_rate": 0.75,
        "fn/polite/candidate": 1.0,
        "agreement_reward": 0.9,
        "agreement_reward_n": 4.0,
        "champion/error_rate": 0.5,
        "canary/error_rate": 0.25,
        "canary/errors/timeout": 1.0,
        "promoted": 0.0,
        "wall_time_s": 3.0,
        "awaiting_people": 1.0,
    }
    online_figures, pairs, canary = pending.recorded(logged)
    assert online_figures == {"prompts": 6.0, "win_rate": 0.75, "fn/polite/candidate": 1.0} and pairs == 6
    assert canary == {"error_rate": 0.25, "errors/timeout": 1.0}
    assert pending.recorded({"canary/error_rate": 1.0, "promoted": 0.0}) == (None, 0, {"error_rate": 1.0})


def people_said(client, version: str, rate: float, decided: int, agreement: float | None = None) -> str:
    """A finished feedback run as `kubealign feedback pull` logs one (kubealign.feedback.lookup reads it)."""
    from kubealign.feedback import lookup

    experiment = client.get_experiment_by_name(EXPERIMENT) or client.get_experiment(
        client.create_experiment(EXPERIMENT)
    )
    tags = {"kubealign.stage": "feedback", lookup.MODEL_TAG: NAME}
    if agreement is not None:
        tags[lookup.AGREEMENT_TAG] = NAME
    run = client.create_run(experiment.experiment_id, tags=tags)
    client.log_metric(run.info.run_id, f"decided_version_{version}", decided)
    client.log_metric(run.info.run_id, f"human_win_rate_version_{version}", rate)
    for judge in ("reward", "heldout") if agreement is not None else ():
        client.log_metric(run.info.run_id, f"agreement_{judge}", agreement)
        client.log_metric(run.info.run_id, f"agreement_{judge}_n", decided)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_a_judge_that_waits_moves_nothing_and_the_next_run_settles_it_once_people_decide(
    setup,  # noqa: F811
    kube,  # noqa: F811
    split: Path,  # noqa: F811
    tmp_path: Path,
    cli,
) -> None:
    from kubealign.models import loading

    uri, client, config = setup
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "3")
    curt = Completions(lambda p: " No, I cannot help.", models=listing(NAME, "1"))
    courteous = Completions(lambda p: " Certainly! Here it is.", models=listing(NAME, "3"))
    try:
        base = ["judge", "--config", judge_config(tmp_path), "--prompts", split]
        base += ["--tokenizer", loading.resolve("tiny-opt"), "--champion", curt.url, "--canary", courteous.url]
        sets = [f"promote.registered_model={NAME}", "tracking.enabled=true", f"tracking.uri={uri}", *WAITS]
        done = cli(*base, "--output", tmp_path / "j", "--act", *[x for s in sets for x in ("--set", s)])
    finally:
        curt.stop()
        courteous.stop()
    assert done.code == 0, done.err
    line = "judge: challenger (version 3) awaits people's choices (canary.await_people): it keeps serving its share"
    assert line in done.out and "registry and serving unchanged" in done.out
    result = json.loads((tmp_path / "j" / "result.json").read_text())
    assert result["awaiting_people"] and not result["promoted"] and result["metrics"]["awaiting_people"] == 1.0
    assert aliases(client) == {"champion": "1", "challenger": "3"}
    run = client.get_run(result["judge_run"])
    assert {k: run.data.tags[k] for k in pending.tags(NAME, "3", "1")} == pending.tags(NAME, "3", "1")

    # the next run: people have not decided yet, so it keeps waiting, nothing touched
    ns = "serve.namespace=team-a"
    cfg = config(ns, *WAITS, "promote.guards.min_judge_agreement=0.6")
    waited = settle.run(cfg, tmp_path / "s1", custom=kube.client())
    assert waited["why"] == "people have not decided on version 3 yet: it keeps serving its share"
    assert not waited["acted"] and kube.requests == [] and aliases(client) == {"champion": "1", "challenger": "3"}
    # a pull whose tasks on it were all tied (no win-rate: NaN) has decided nothing either
    people_said(client, "3", float("nan"), 2)
    waited = settle.run(cfg, tmp_path / "s1b", custom=kube.client())
    assert waited["why"] == "people have not decided on version 3 yet: it keeps serving its share"
    assert kube.requests == [] and aliases(client) == {"champion": "1", "challenger": "3"}

    # they decide for it (6 of 8), and find both automatic judges wrong: the recorded figures with their verdict
    source = people_said(client, "3", 0.75, 8, agreement=0.25)
    done = settle.run(cfg, tmp_path / "s2", custom=kube.client())
    assert done["acted"] and done["promoted"] and done["judge_run"] == result["judge_run"]
    assert done["verdict"] == "judge: challenger (version 3) holds online: promoted to champion"
    # the judge's recorded win-rate, its judge now distrusted by this run's pull (agreement 0.25 < 0.6)
    doubted = "not trusted: win_rate: needs >= 0.5, got 1.000 [reward agrees with people on 0.25 over 8 tasks, below"
    assert any(line.startswith(doubted) for line in done["checks"])
    people = f"pass: people's win-rate over 8 tasks: needs >= canary.min_human_win_rate 0.5, got 0.750 (feedback run {source})"
    assert people in done["checks"]
    leaning = "pass: trusted judges: needs >= 1 (promote.guards.min_judge_agreement), got 0; the gate leans on people's win-rate alone"
    assert leaning in done["checks"]
    assert aliases(client) == {"champion": "3", "previous-champion": "1"}
    assert list(kube.objects) == [("team-a", NAME)] and done["inference_service"] == f"team-a/{NAME}"
    # a rerun finds no challenger: nothing is decided twice
    again = settle.run(cfg, tmp_path / "s3", custom=kube.client())
    assert again["why"] == f"{NAME} has no challenger: no canary waits for people" and not again["acted"]


def judged(client, version: str, champion: str, win: float) -> str:
    """A finished judge run waiting for people on `version`, compared with `champion`, as the judge logs one."""
    experiment = client.get_experiment_by_name(EXPERIMENT) or client.get_experiment(
        client.create_experiment(EXPERIMENT)
    )
    run = client.create_run(
        experiment.experiment_id, tags={"kubealign.stage": "judge", **pending.tags(NAME, version, champion)}
    )
    figures = {k: v for k, v in online(win, 0.3).items() if v == v}  # the NaN KL is not measured online
    figures.update({"prompts": 8.0, "canary/error_rate": 0.0, "canary/latency_p95_s": 0.5, "awaiting_people": 1.0})
    for key, value in figures.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_settle_leaves_what_no_longer_holds_and_rolls_back_what_people_refuse(setup, kube, tmp_path: Path) -> None:  # noqa: F811
    uri, client, config = setup
    cfg = config("serve.namespace=team-a", *WAITS, "canary.min_answers=8")
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "3")
    judged(client, "2", "1", 0.7)  # about another version than the challenger
    people_said(client, "3", 0.25, 8)
    left = settle.run(cfg, tmp_path / "a", custom=kube.client())
    assert left["why"] == "challenger version 3 has no judgement waiting for people: left as it is"
    judged(client, "3", "2", 0.7)  # compared with another champion than today's
    left = settle.run(cfg, tmp_path / "b", custom=kube.client())
    assert left["why"] == (
        "version 3 was judged against champion version 2, the champion is now 1: the judgement no longer holds; "
        "left as it is"
    )
    off = settle.run(config("serve.namespace=team-a"), tmp_path / "c", custom=kube.client())
    assert off["why"] == "canary.await_people is false: no verdict waits for people"
    assert kube.requests == [] and aliases(client) == {"champion": "1", "challenger": "3"} and rejected(client) == []
    # the newest waiting judgement about version 3 against champion 1: people refuse it (2 of 8), it is rolled back
    run_id = judged(client, "3", "1", 0.7)
    done = settle.run(cfg, tmp_path / "d", custom=kube.client())
    assert done["acted"] and not done["promoted"] and done["judge_run"] == run_id
    assert done["verdict"].startswith("judge: challenger (version 3) rolled back: people's win-rate over 8 tasks")
    assert aliases(client) == {"champion": "1"} and rejected(client) == ["3"]
    assert list(kube.objects) == [("team-a", NAME)]
    saved = json.loads((tmp_path / "d" / "result.json").read_text())
    assert saved["stage"] == "settle" and saved["metrics"]["human_win_rate"] == 0.25


def test_the_act_task_carries_out_nothing_while_the_verdict_waits(setup, kube, tmp_path: Path) -> None:  # noqa: F811
    uri, client, config = setup
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "3")
    waiting = verdict(tmp_path, "w", False, "3", f"team-a/{NAME}")
    body = json.loads((waiting / "verdict.json").read_text())
    (waiting / "verdict.json").write_text(json.dumps({**body, "awaiting_people": True}), encoding="utf-8")
    done = act_task.run(config("serve.namespace=team-a", *WAITS), waiting, tmp_path / "a", custom=kube.client())
    assert not done["acted"] and done["why"].startswith("version 3 awaits people's choices (canary.await_people)")
    assert aliases(client) == {"champion": "1", "challenger": "3"} and kube.requests == [] and rejected(client) == []
    (waiting / "verdict.json").write_text(json.dumps({**body, "awaiting_people": "yes"}), encoding="utf-8")
    with pytest.raises(Exception, match="\"awaiting_people\" is 'yes', not true or false"):
        act_task.run(config("serve.namespace=team-a", *WAITS), waiting, tmp_path / "b", custom=kube.client())


def test_a_record_with_no_comparison_in_it_rolls_the_canary_back_whatever_people_say(
    setup,  # noqa: F811
    kube,  # noqa: F811
    tmp_path: Path,
) -> None:
    """As an adversary with the tracking identity would write one: tagged as a waiting judge run of the challenger,
    but holding no online comparison. People approve (8 of 8); the decision still fails on the missing answers."""
    uri, client, config = setup
    cfg = config("serve.namespace=team-a", *WAITS, "canary.min_answers=8")
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "3")
    experiment = client.get_experiment_by_name(EXPERIMENT) or client.get_experiment(
        client.create_experiment(EXPERIMENT)
    )
    run = client.create_run(experiment.experiment_id, tags={"kubealign.stage": "judge", **pending.tags(NAME, "3", "1")})
    client.log_metric(run.info.run_id, "canary/error_rate", 0.0)
    client.set_terminated(run.info.run_id)
    people_said(client, "3", 1.0, 8)
    done = settle.run(cfg, tmp_path / "s", custom=kube.client())
    assert done["acted"] and not done["promoted"]
    assert "FAIL: prompts answered by both: needs >= canary.min_answers 8, got 0" in done["checks"]
    assert aliases(client) == {"champion": "1"} and rejected(client) == ["3"]
