"""The pipeline section: pipeline.candidates picks what trains; the deprecated pipeline.algorithm and
pipeline.algorithms are read as the same candidates, with one deprecation line where a user's config is loaded
(not where a task reads its config_json); their conflicts; and the one rule of which route has a critic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubealign.config import config_from_json, config_to_json, load_config
from kubealign.config import load as loading
from kubealign.config.candidates import Candidate
from kubealign.config.schema import PPOConfig
from kubealign.errors import UserError
from kubealign.shape import ROUTES, has_critic

GRPO_DPO = "pipeline.candidates=[{route: grpo}, {route: dpo}]"


@pytest.fixture(autouse=True)
def _nothing_said_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: no deprecation line printed yet, not a torchrun rank."""
    monkeypatch.setattr(loading, "_SAID", set())
    monkeypatch.delenv("RANK", raising=False)


def said(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


# --- the shorthand, read as candidates --------------------------------------------------------------------


@pytest.mark.parametrize("route", ["grpo", "rloo", "dpo"])
def test_algorithm_is_one_candidate_named_after_its_route(route: str, capsys) -> None:
    old = load_config(None, [f"pipeline.algorithm={route}"])
    new = load_config(None, [f"pipeline.candidates=[{{route: {route}}}]"])
    assert old == new  # the same config: what compiles, runs and is recorded does not tell them apart
    assert old.candidates() == (Candidate(route, route, {}),) and old.route() == route and not old.several()
    assert old.candidate_names() == (route,)


def test_algorithm_ppo_leaves_the_route_to_ppo_algorithm_as_it_always_did(capsys) -> None:
    """ppo was pipeline.algorithm's default: with it, ppo.algorithm picked grpo or rloo."""
    assert load_config(None, ["pipeline.algorithm=ppo"]).candidates() == (Candidate("ppo", "ppo", {}),)
    config = load_config(None, ["pipeline.algorithm=ppo", "ppo.algorithm=rloo"])
    assert config.candidates() == (Candidate("rloo", "rloo", {}),) and config == load_config(
        None, ["ppo.algorithm=rloo"]
    )
    assert said(capsys) == [
        "kubealign: pipeline.algorithm is deprecated: write pipeline.candidates: [{route: ppo}]",
        "kubealign: pipeline.algorithm is deprecated: write pipeline.candidates: [{route: rloo}]",
    ]


def test_algorithms_is_one_candidate_per_route_in_order(capsys) -> None:
    old = load_config(None, ["pipeline.algorithms=[grpo,dpo]"])
    assert old == load_config(None, [GRPO_DPO])
    assert old.candidates() == (Candidate("grpo", "grpo", {}), Candidate("dpo", "dpo", {})) and old.several()
    four = load_config(None, [f"pipeline.algorithms=[{','.join(ROUTES)}]"])
    assert four.candidate_names() == ROUTES == four.routes()
    one = load_config(None, ["pipeline.algorithms=[grpo]"])  # one entry: the one-route run
    assert one == load_config(None, ["pipeline.algorithm=grpo"]) and not one.several()


def test_the_config_as_read_holds_candidates_only(capsys) -> None:
    config = load_config(None, ["pipeline.algorithms=[rloo,dpo]"])
    section = json.loads(config_to_json(config))["pipeline"]
    assert section["candidates"] == [
        {"name": None, "route": "rloo", "set": {}, "sweep": {}},
        {"name": None, "route": "dpo", "set": {}, "sweep": {}},
    ]
    assert "algorithm" not in section and "algorithms" not in section
    assert not hasattr(config.pipeline, "algorithm") and not hasattr(config.pipeline, "algorithms")


# --- the one deprecation line -----------------------------------------------------------------------------


def test_one_deprecation_line_naming_the_exact_replacement(cli) -> None:
    result = cli("config", "show", "--set", "pipeline.algorithms=[grpo,dpo]")
    assert result.code == 0 and "candidates:" in result.out
    assert result.err.splitlines() == [
        "kubealign: pipeline.algorithms is deprecated: write pipeline.candidates: [{route: grpo}, {route: dpo}]"
    ]
    loading._SAID.clear()
    result = cli("config", "show", "--set", "pipeline.algorithm=dpo")
    assert result.err.splitlines() == [
        "kubealign: pipeline.algorithm is deprecated: write pipeline.candidates: [{route: dpo}]"
    ]


def test_the_line_for_a_file_and_once_per_process(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pipeline:\n  algorithm: grpo\n  max_kl: 2.0\n", encoding="utf-8")
    first = load_config(path)
    assert first.route() == "grpo" and first.pipeline.max_kl == 2.0
    load_config(path)  # loaded again in the same process: not said again
    assert said(capsys) == ["kubealign: pipeline.algorithm is deprecated: write pipeline.candidates: [{route: grpo}]"]


def test_the_suggested_replacement_reads_as_the_same_config(capsys) -> None:
    old = load_config(None, ["pipeline.algorithms=[ppo,rloo,dpo]"])
    (line,) = said(capsys)
    replacement = line.split("write ", 1)[1].replace(": ", "=", 1)
    assert old == load_config(None, [replacement]) and said(capsys) == []


def test_no_line_for_candidates_for_a_task_or_for_a_torchrun_rank(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    load_config(None, [GRPO_DPO])
    load_config(None, [])
    load_config("tiny-cpu-verifiable")  # a preset: written with pipeline.candidates
    # a task reads its config_json (the DAG's, or an index's from an older run): no line, once per task
    old_json = json.dumps({"pipeline": {"algorithm": "grpo", "algorithms": None, "candidates": None}})
    assert config_from_json(old_json).candidates() == (Candidate("grpo", "grpo", {}),)
    monkeypatch.setenv("RANK", "1")
    load_config(None, ["pipeline.algorithm=grpo"])
    assert said(capsys) == []


def test_an_error_is_one_line_with_no_deprecation_line(cli) -> None:
    result = cli("config", "show", "--set", "pipeline.algorithms=[grpo,rloo]", "--set", "ppo.samples_per_prompt=1")
    assert result.code == 2 and len(result.err.splitlines()) == 1
    assert "candidate grpo: field 'ppo': ppo.algorithm grpo needs ppo.samples_per_prompt >= 2" in result.err


# --- conflicts and bad values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["pipeline.algorithm=dpo", "pipeline.algorithms=[grpo,dpo]"],
            "preset tiny-cpu: pipeline.algorithm dpo and pipeline.algorithms both set: keep one "
            "(algorithm is the one-route spelling of algorithms)",
        ),
        (
            ["pipeline.algorithms=[ppo,dpo]", "pipeline.candidates=[{route: dpo}]"],
            "preset tiny-cpu: pipeline.candidates and pipeline.algorithm(s) both set: keep candidates "
            "(each names its route)",
        ),
        (
            ["pipeline.algorithm=rloo", "pipeline.candidates=[{route: dpo}]"],
            "preset tiny-cpu: pipeline.candidates and pipeline.algorithm(s) both set: keep candidates "
            "(each names its route)",
        ),
        (
            ["pipeline.algorithms=[grpo,dpo,grpo]"],
            "preset tiny-cpu: pipeline.algorithms: each route at most once; repeated: grpo",
        ),
        (["pipeline.algorithms=[]"], "preset tiny-cpu: pipeline.algorithms: List should have at least 1 item"),
        (["pipeline.algorithms=[sac]"], "preset tiny-cpu: pipeline.algorithms.0: Input should be 'ppo', 'grpo'"),
        (["pipeline.algorithm=sac"], "preset tiny-cpu: pipeline.algorithm: Input should be 'ppo', 'grpo'"),
    ],
)
def test_conflicts_and_bad_values_are_one_line_naming_the_fields(overrides: list[str], message: str, capsys) -> None:
    with pytest.raises(UserError) as caught:
        load_config(None, overrides)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert said(capsys) == []


def test_algorithm_ppo_beside_candidates_is_no_conflict(capsys) -> None:
    """pipeline.algorithm ppo was the default, written out by every dumped config: it picks nothing."""
    config = load_config(None, ["pipeline.algorithm=ppo", "pipeline.candidates=[{route: dpo}]"])
    assert config.candidates() == (Candidate("dpo", "dpo", {}),)
    assert said(capsys) == [
        "kubealign: pipeline.algorithm is deprecated: remove it (pipeline.candidates picks what trains)"
    ]


# --- which route has a critic -----------------------------------------------------------------------------


def test_only_ppo_has_a_critic() -> None:
    assert has_critic("ppo")
    assert not any(has_critic(route) for route in ("grpo", "rloo", "dpo"))
    assert PPOConfig(algorithm="ppo").has_critic and PPOConfig().has_critic
    assert not PPOConfig(algorithm="grpo").has_critic and not PPOConfig(algorithm="rloo").has_critic
    # critic-free variants compare a prompt's responses: groups of 4 unless set
    assert [PPOConfig(algorithm=a).group_size for a in ("ppo", "grpo", "rloo")] == [1, 4, 4]


def test_a_candidate_that_names_its_route_algorithm_is_read_with_one_line(capsys) -> None:
    """`algorithm` was a candidate's spelling of its route: still read, as the same config, with one line naming
    the entries that use it; both spellings in one entry are refused."""
    old = load_config(None, ["pipeline.candidates=[{route: ppo}, {algorithm: dpo, set: {dpo.beta: 0.2}}]"])
    assert said(capsys) == ["kubealign: pipeline.candidates[1]: `algorithm` is deprecated: write `route` (same value)"]
    assert old == load_config(None, ["pipeline.candidates=[{route: ppo}, {route: dpo, set: {dpo.beta: 0.2}}]"])
    assert old.candidates()[1] == Candidate("dpo", "dpo", {"dpo.beta": 0.2}) and said(capsys) == []
    with pytest.raises(UserError, match="both route and algorithm"):
        load_config(None, ["pipeline.candidates=[{route: ppo, algorithm: grpo}]"])


def test_a_candidate_read_back_from_an_older_index_keeps_its_route() -> None:
    assert Candidate.from_dict({"name": "b", "algorithm": "dpo", "set": {"dpo.beta": 1}}) == Candidate(
        "b", "dpo", {"dpo.beta": 1}
    )
    assert Candidate.from_dict({"name": "g", "route": "grpo"}) == Candidate("g", "grpo", {})
    assert Candidate.from_dict(Candidate("x", "rloo", {"ppo.top_k": 3}).as_dict()) == Candidate(
        "x", "rloo", {"ppo.top_k": 3}
    )
