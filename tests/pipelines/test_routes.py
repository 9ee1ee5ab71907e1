"""Several routes in one pipeline run (pipeline.candidates, one per route): the ranking rule by hand-made evaluations,
the config, the compiled DAG, and runs through kfp.local: a leaderboard, only the leader promoted, a failed
route that does not sink the others, one more route added with --cache, and `kubealign rerun ROUTE`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2
from mlflow.tracking import MlflowClient

from kubealign.cli import main
from kubealign.config import load_config
from kubealign.errors import UserError
from kubealign.outputs import write_result
from kubealign.pipelines.local import tasks_for
from kubealign.pipelines.remote import compile_pipeline
from kubealign.selection import ranking
from kubealign.stages import compare
from tests.pipelines.test_kfp_local import SHORT as KFP_SHORT

ROUTES4 = "pipeline.candidates=[{route: ppo}, {route: grpo}, {route: rloo}, {route: dpo}]"


def candidates(routes: str) -> str:
    """The --set override of one candidate per route, each named after it: "grpo,dpo" ->
    pipeline.candidates=[{route: grpo}, {route: dpo}]."""
    return "pipeline.candidates=[" + ", ".join(f"{{route: {r}}}" for r in routes.split(",")) + "]"


def evaluation(bound: float, reward: float, kl: float, **more: float) -> dict[str, float]:
    return {"win_rate_lower_bound": bound, "candidate_reward_mean": reward, "kl_to_baseline": kl, **more}


# --- the ranking rule -------------------------------------------------------------------------------------


def test_rank_by_the_bound_then_reward_then_lower_kl_then_the_listed_order() -> None:
    evaluations = {
        "ppo": evaluation(0.50, 1.0, 0.3),  # ties grpo and rloo on the bound, beats them on reward
        "grpo": evaluation(0.50, 0.8, 0.2),  # ties rloo on bound and reward, lower KL
        "rloo": evaluation(0.50, 0.8, 0.4),
        "dpo": evaluation(0.625, 0.1, 9.0),  # the best bound wins whatever its reward and KL
    }
    standings = ranking.rank(evaluations, "win_rate", ["ppo", "grpo", "rloo", "dpo"])
    assert [(s.candidate, s.rank) for s in standings] == [("dpo", 1), ("ppo", 2), ("grpo", 3), ("rloo", 4)]
    assert standings[0].why == ""
    assert standings[1].why == "win_rate_lower_bound 0.5 < dpo's 0.625"
    assert [s.measure for s in standings] == [0.625, 0.5, 0.5, 0.5]
    # among the three that tie on the bound: reward decides, then KL
    tied = ranking.rank({k: v for k, v in evaluations.items() if k != "dpo"}, "win_rate", ["ppo", "grpo", "rloo"])
    assert [s.candidate for s in tied] == ["ppo", "grpo", "rloo"]
    assert tied[1].why == "tied on win_rate_lower_bound; candidate_reward_mean 0.8 < ppo's 1"
    two = ranking.rank({k: evaluations[k] for k in ("rloo", "grpo")}, "win_rate", ["rloo", "grpo"])
    assert [s.candidate for s in two] == ["grpo", "rloo"]
    assert two[1].why == "tied on win_rate_lower_bound, candidate_reward_mean; kl_to_baseline 0.4 > grpo's 0.2"


def test_a_complete_tie_goes_to_the_route_listed_first() -> None:
    same = evaluation(0.5, 0.8, 0.2)
    for order in (["grpo", "rloo"], ["rloo", "grpo"]):
        standings = ranking.rank({"grpo": same, "rloo": dict(same)}, "win_rate", order)
        assert [s.candidate for s in standings] == order
        assert standings[1].why == (
            f"tied with {order[0]} on win_rate_lower_bound, candidate_reward_mean, kl_to_baseline; "
            f"{order[0]} is listed first"
        )


def test_another_promote_metric_ranks_first() -> None:
    evaluations = {
        "grpo": evaluation(0.9, 2.0, 0.1, **{"fn/exact/candidate": 0.40}),
        "rloo": evaluation(0.1, 0.0, 5.0, **{"fn/exact/candidate": 0.75}),
    }
    standings = ranking.rank(evaluations, "fn/exact/candidate", ["grpo", "rloo"])
    assert [s.candidate for s in standings] == ["rloo", "grpo"] and standings[0].measure == 0.75
    with pytest.raises(UserError, match="the grpo evaluation has no fn/other/candidate"):
        ranking.rank(evaluations, "fn/other/candidate", ["grpo", "rloo"])


def fake_evaluation(directory: Path, metrics: dict[str, float]) -> Path:
    directory.mkdir(parents=True)
    write_result(directory, "evaluate", {"win_rate": 0.5, "win_rate_upper_bound": 0.7, **metrics}, {})
    return directory


def test_compare_stage_names_the_failed_route_and_fails_with_none_left(tmp_path: Path) -> None:
    config = load_config(None, ["tracking.enabled=false", candidates("grpo,rloo,dpo")])
    evaluations = {
        "grpo": fake_evaluation(tmp_path / "g", evaluation(0.40, 0.9, 0.1)),
        "rloo": None,  # its training failed: no evaluation
        "dpo": fake_evaluation(tmp_path / "d", evaluation(0.45, 0.2, 0.3)),
    }
    result = compare.run(config, config.candidates(), evaluations, tmp_path / "out")
    assert result["leader"] == "dpo" and result["failed"] == ["rloo"]
    assert [s["candidate"] for s in result["standings"]] == ["dpo", "grpo"]
    assert result["metrics"]["rank/dpo"] == 1.0 and result["metrics"]["rank/grpo"] == 2.0
    assert result["metrics"]["leaderboard/grpo"] == 0.40 and result["metrics"]["routes_failed"] == 1.0
    table = (tmp_path / "out" / "leaderboard.md").read_text(encoding="utf-8").splitlines()
    # grpo (KL 0.1, reward 0.9) dominates dpo (0.3, 0.2): the leader by the bound is off the reward-KL front
    assert table[4] == "| 1 | dpo | dpo | (its section's) | 0.500 [0.450, 0.700] | 0.2000 | 0.3000 |  | leader |"
    assert result["front"] == ["grpo"]
    assert table[5].startswith("| 2 | grpo | grpo |") and "win_rate_lower_bound 0.4 < dpo's 0.45" in table[5]
    assert table[5].endswith("| 0.9000 | 0.1000 | on the front | win_rate_lower_bound 0.4 < dpo's 0.45 |")
    assert table[6].startswith("| – | rloo | | | failed")
    page = (tmp_path / "out" / "frontier.html").read_text(encoding="utf-8")
    assert "data:image/png;base64," in page and "Failed, not ranked: rloo" in page and "leader: dpo" in page
    assert (tmp_path / "out" / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    two = config.candidates()[:2]
    with pytest.raises(UserError, match=r"no candidate left: every route failed \(grpo, rloo\)"):
        compare.run(config, two, {"grpo": None, "rloo": None}, tmp_path / "none")
    assert not (tmp_path / "none").exists()


# --- config and the compiled DAG --------------------------------------------------------------------------


def test_routes_config() -> None:
    """One candidate per route (the deprecated pipeline.algorithm(s): tests/pipelines/test_pipeline_config.py)."""
    assert load_config(None, [ROUTES4]).routes() == ("ppo", "grpo", "rloo", "dpo")
    assert load_config(None, [candidates("dpo")]).routes() == ("dpo",)
    assert load_config(None, ["ppo.algorithm=rloo"]).routes() == ("rloo",)
    for bad, said in (
        (candidates("grpo,dpo,grpo"), "candidate name 'grpo' is used twice"),
        (candidates("sac"), "pipeline.candidates.0.route"),
    ):
        with pytest.raises(UserError, match=said):
            load_config(None, [bad])
    with pytest.raises(
        UserError, match="candidate rloo: field 'ppo': ppo.algorithm rloo needs ppo.samples_per_prompt >= 2"
    ):
        load_config(None, [candidates("ppo,rloo"), "ppo.samples_per_prompt=1"])


def spec_of(tmp_path: Path, overrides: list[str]) -> tuple[str, pipeline_spec_pb2.PipelineSpec]:
    path = compile_pipeline(load_config(None, overrides), tmp_path / "pipeline.yaml")
    text = path.read_text(encoding="utf-8")
    doc = next(yaml.safe_load_all(text))
    return text, json_format.ParseDict(doc, pipeline_spec_pb2.PipelineSpec())


@pytest.mark.kfp
def test_one_listed_route_compiles_to_todays_dag(tmp_path: Path) -> None:
    """One candidate compiles as the route alone did, and so do the deprecated spellings of it."""
    spelled = (candidates("grpo"), "ppo.algorithm=grpo", "pipeline.algorithm=grpo", "pipeline.algorithms=[grpo]")
    texts = []
    for number, override in enumerate(spelled):
        (tmp_path / str(number)).mkdir()
        texts.append(spec_of(tmp_path / str(number), [override])[0])
    assert all(text == texts[0] for text in texts)


@pytest.mark.kfp
def test_four_routes_compile_and_validate(tmp_path: Path) -> None:
    _, spec = spec_of(tmp_path, [ROUTES4])
    tasks = spec.root.dag.tasks
    routes = ["ppo", "grpo", "rloo", "dpo"]
    expected = {"data-split", "sft", "reward", "compare", *routes}
    expected |= {f"{prefix}-{r}" for r in routes for prefix in ("evaluate", "promote")}
    assert set(tasks) == expected
    for route in routes:
        trained = tasks[route]
        assert sorted(trained.dependent_tasks) == (
            ["data-split", "sft"] if route == "dpo" else ["data-split", "reward", "sft"]
        )
        if route != "dpo":  # the ppo component, with the route as its algorithm
            assert trained.inputs.parameters["algorithm"].runtime_value.constant.string_value == route
        evaluated = tasks[f"evaluate-{route}"]
        # every candidate against the same SFT baseline, same prompts, same config (same sampling seeds)
        assert evaluated.inputs.artifacts["baseline"].task_output_artifact.producer_task == "sft"
        assert evaluated.inputs.artifacts["prompts"].task_output_artifact.producer_task == "data-split"
        assert evaluated.inputs.artifacts["candidate"].task_output_artifact.producer_task == route
        assert evaluated.inputs.parameters["config_json"].component_input_parameter == "config_json"
        promoted = tasks[f"promote-{route}"]
        assert sorted(promoted.dependent_tasks) == sorted(["compare", route, f"evaluate-{route}"])
        assert not promoted.caching_options.enable_cache
    comparison = tasks["compare"]
    strategy = pipeline_spec_pb2.PipelineTaskSpec.TriggerPolicy.TriggerStrategy
    assert comparison.trigger_policy.strategy == strategy.ALL_UPSTREAM_TASKS_COMPLETED
    assert {k: v.task_output_artifact.producer_task for k, v in comparison.inputs.artifacts.items()} == {
        f"evaluation_{n}": f"evaluate-{r}" for n, r in enumerate(routes, start=1)
    }
    assert "algorithm" not in spec.root.input_definitions.parameters  # the routes are compiled in
    assert set(spec.root.output_definitions.artifacts) == {"data_split", "sft", "reward", "compare"}


@pytest.mark.kfp
def test_two_routes_declare_only_their_evaluations(tmp_path: Path) -> None:
    _, spec = spec_of(tmp_path, [candidates("rloo,dpo")])
    comparison = spec.root.dag.tasks["compare"]
    assert set(comparison.inputs.artifacts) == {"evaluation_1", "evaluation_2"}
    declared = spec.components[comparison.component_ref.name].input_definitions.artifacts
    assert set(declared) == {"evaluation_1", "evaluation_2"}
    listed = json.loads(comparison.inputs.parameters["candidates"].runtime_value.constant.string_value)
    assert listed == [{"name": "rloo", "route": "rloo", "set": {}}, {"name": "dpo", "route": "dpo", "set": {}}]


def test_task_list_of_a_several_route_run() -> None:
    config = load_config(None, [candidates("grpo,dpo")])
    assert tasks_for(config) == (
        "data-split",
        "sft",
        "reward",
        "grpo",
        "evaluate-grpo",
        "dpo",
        "evaluate-dpo",
        "compare",
        "promote-grpo",
        "promote-dpo",
    )
    assert tasks_for(load_config(None, [])) == ("data-split", "sft", "reward", "ppo", "evaluate", "promote")


def test_task_list_of_a_served_canary() -> None:
    """serve, judge (the canary online, user code) and act (its verdict carried out, the pipeline identity) end a
    one-route run; with canary.act false the judge only reports. act reads the judge's verdict alone, so a rerun
    of act needs only the judge's output, and a rerun of judge --downstream carries its new verdict out."""
    from kubealign import shape

    served = ["serve.enabled=true", "promote.mode=canary"]
    route = tasks_for(load_config(None, served))
    assert route[-4:] == ("promote", "serve", "judge", "act")
    assert tasks_for(load_config(None, [*served, "canary.act=false"]))[-3:] == ("promote", "serve", "judge")
    assert shape.upstream("act", route) == ("judge",)
    assert shape.downstream_of("judge", route) == ["act"] and shape.downstream_of("serve", route) == ["judge", "act"]
    assert "act" in shape.RESERVED_TASKS and shape.output_key("act") == "acted" and shape.route_of("act") is None


# --- through kfp.local ------------------------------------------------------------------------------------

SHORT = [
    *KFP_SHORT,
    # dpo fails at its start (its LoRA targets no module): a route that fails, the others unaffected
    "dpo.lora.r=4",
    "dpo.lora.only_lora=true",
    "dpo.lora.target_modules=[no_such_module]",
]


def run_args(routes: str, output: Path) -> list[str]:
    sets = [arg for item in [*SHORT, candidates(routes)] for arg in ("--set", item)]
    return ["run", *sets, "--output", str(output), "--cache"]


@pytest.fixture(scope="module")
def routes_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[str]]:
    """ppo, grpo and a dpo route that fails, in one run; returns (output, run.json, printed lines)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("routes") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(run_args("ppo,grpo,dpo", out)) == 0
    return out, json.loads((out / "run.json").read_text(encoding="utf-8")), printed.getvalue().splitlines()


def read(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "result.json").read_text(encoding="utf-8"))


@pytest.mark.kfp
@pytest.mark.integration
def test_a_failed_route_does_not_sink_the_others(routes_run) -> None:
    out, index, printed = routes_run
    assert index["succeeded"] and index["algorithms"] == ["ppo", "grpo", "dpo"]
    assert list(index["failed_routes"]) == ["dpo"]
    assert "lora.target_modules" in index["failed_routes"]["dpo"] and "logs/dpo.log" in index["failed_routes"]["dpo"]
    assert not {"dpo", "evaluate-dpo", "promote-dpo"} & set(index["stages"])
    comparison = read(index["stages"]["compare"]["dir"])
    assert comparison["failed"] == ["dpo"] and {s["candidate"] for s in comparison["standings"]} == {"ppo", "grpo"}
    states = {line.split()[0]: line.split()[1] for line in printed[: printed.index("")]}
    assert states["dpo"] == "FAILED" and states["evaluate-dpo"] == states["promote-dpo"] == "skipped"
    assert any(line.startswith("- dpo") and "FAILED: task dpo failed" in line for line in printed)


@pytest.mark.kfp
@pytest.mark.integration
def test_leaderboard_artifacts_and_only_the_leader_promoted(routes_run) -> None:
    out, index, printed = routes_run
    comparison = read(index["stages"]["compare"]["dir"])
    leader, second = (s["candidate"] for s in comparison["standings"])
    evaluations = {r: read(index["stages"][f"evaluate-{r}"]["dir"])["metrics"] for r in (leader, second)}
    # the ranking the stage made is the rule's, on the evaluations it read
    assert [s.candidate for s in ranking.rank(evaluations, "win_rate", ["ppo", "grpo"])] == [leader, second]
    # the KFP UI's artifacts: the compare task's Markdown and HTML outputs
    task_dir = Path(index["stages"]["compare"]["dir"]).parent
    markdown = (task_dir / "leaderboard").read_text(encoding="utf-8")
    assert f"| 1 | {leader} |" in markdown and f"| 2 | {second} |" in markdown and "| – | dpo | | | failed" in markdown
    assert "data:image/png;base64," in (task_dir / "report").read_text(encoding="utf-8")
    # the registry: both candidates registered, tagged; only the leader holds an alias
    client = MlflowClient(index["mlflow"]["tracking_uri"])
    versions = {}
    for route in (leader, second):
        promoted = read(index["stages"][f"promote-{route}"]["dir"])
        version = client.get_model_version("kubealign-actor", str(promoted["version"]))
        assert version.tags["kubealign.algorithm"] == route and version.tags["kubealign.leader"] == leader
        versions[route] = (version, promoted)
    assert versions[leader][0].tags["kubealign.rank"] == "1" and versions[second][0].tags["kubealign.rank"] == "2"
    aliases = client.get_registered_model("kubealign-actor").aliases
    assert str(aliases["champion"]) == str(aliases["challenger"]) == str(versions[leader][1]["version"])
    assert str(versions[second][1]["version"]) not in {str(v) for v in aliases.values()}
    assert versions[second][1]["comparison"]["verdict"].startswith("not the leader (rank 2): ")
    assert versions[leader][1]["comparison"]["others"] == {
        second: f"rank 2: {comparison['standings'][1]['why']}",
        "dpo": "failed: not ranked",
    }
    # MLflow: on the pipeline's run, the table and one metric per route
    parent = client.get_run(index["mlflow"]["parent_run_id"])
    assert parent.data.metrics[f"leaderboard/{leader}"] == evaluations[leader]["win_rate_lower_bound"]
    assert f"leaderboard/{second}" in parent.data.metrics
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "leaderboard.json")).read_text())
    assert table["data"][0][table["columns"].index("route")] == leader
    # the closing summary: one line per route, in rank order
    ranked = [line for line in printed if line[:2] in ("1 ", "2 ")]
    assert ranked[0].split()[:2] == ["1", leader] and ranked[1].split()[:2] == ["2", second]
    assert "champion" in ranked[0] and f"behind: {comparison['standings'][1]['why']}" in ranked[1]


@pytest.mark.kfp
@pytest.mark.integration
def test_one_more_route_with_cache_trains_only_it(routes_run, tmp_path: Path, capsys) -> None:
    _, index, _ = routes_run
    assert main(run_args("ppo,grpo,dpo,rloo", tmp_path / "more")) == 0
    printed = capsys.readouterr().out.splitlines()
    ran = {line.split()[0] for line in printed[: printed.index("")] if line.split()[1] == "running"}
    # the new route, the comparison and the promotions (never cached); dpo fails again (not cached)
    assert ran == {"rloo", "evaluate-rloo", "dpo", "compare", "promote-ppo", "promote-grpo", "promote-rloo"}
    second = json.loads((tmp_path / "more" / "run.json").read_text(encoding="utf-8"))
    for task in ("data-split", "sft", "reward", "ppo", "evaluate-ppo", "grpo", "evaluate-grpo"):
        assert second["stages"][task]["dir"] == index["stages"][task]["dir"], task
    assert {s["candidate"] for s in read(second["stages"]["compare"]["dir"])["standings"]} == {"ppo", "grpo", "rloo"}


@pytest.mark.kfp
@pytest.mark.integration
def test_rerun_one_route_then_the_comparison_and_promotions(routes_run, tmp_path: Path) -> None:
    out, index, _ = routes_run
    target = tmp_path / "again"
    assert main(["rerun", "grpo", "--from", str(out), "--set", "ppo.num_iterations=2", "--output", str(target)]) == 0
    new = json.loads((target / "run.json").read_text(encoding="utf-8"))
    assert new["rerun"] == ["grpo", "evaluate-grpo", "compare", "promote-ppo", "promote-grpo"]
    assert new["reused"] == ["data-split", "evaluate-ppo", "ppo", "reward", "sft"]
    for task in new["reused"]:
        assert new["stages"][task] == index["stages"][task]
    assert len(read(target / "grpo")["history"]) == 2 and read(target / "grpo")["algorithm"] == "grpo"
    assert read(target / "compare")["evaluations"]["ppo"] == index["stages"]["evaluate-ppo"]["dir"]
    assert new["failed_routes"] == {"dpo": "failed in the earlier run (not rerun)"}
    assert math.isfinite(read(target / "evaluate-grpo")["metrics"]["win_rate_upper_bound"])


@pytest.mark.kfp
@pytest.mark.integration
def test_with_no_route_left_the_run_fails_in_one_line(routes_run, cli, tmp_path: Path) -> None:
    # grpo fails at its start like dpo (a LoRA on no module), set on the candidate: the shared tasks' config is
    # routes_run's, so kfp.local's cache holds them and only the branches run. One candidate at a time: dpo
    # waits for grpo's branch, which fails; the wait runs all the same.
    lora = "{ppo.actor_lora.r: 4, ppo.actor_lora.only_lora: true, ppo.actor_lora.target_modules: [no_such_module]}"
    broken = [f"pipeline.candidates=[{{route: grpo, set: {lora}}}, {{route: dpo}}]", "pipeline.parallelism=1"]
    result = cli(*run_args("grpo,dpo", tmp_path / "r"), *(a for item in broken for a in ("--set", item)))
    assert result.code == 2
    assert result.err.splitlines() == [
        "kubealign: error: task compare failed: UserError: compare: no candidate left: every route failed "
        f"(grpo, dpo); see their logs (log: {tmp_path / 'r' / 'logs' / 'compare.log'})"
    ]
    index = json.loads((tmp_path / "r" / "run.json").read_text(encoding="utf-8"))
    assert index["succeeded"] is False and set(index["failed_routes"]) == {"grpo", "dpo"}
    states = {line.split()[0]: line.split()[1] for line in result.out.splitlines()}
    assert states["grpo"] == states["dpo"] == states["compare"] == "FAILED"
    assert states["wait-dpo"] in ("done", "cached")
    assert states["data-split"] == states["sft"] == states["reward"] == "cached"
    assert states["promote-grpo"] == states["promote-dpo"] == "skipped"
