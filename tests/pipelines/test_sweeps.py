"""Candidates in one run (pipeline.candidates): a route with its own settings, sweeps expanded into named
candidates, the reward-KL frontier, the KL budget (pipeline.max_kl), the compiled DAG with six candidates
and a bounded fan-out, and a two-candidate sweep through kfp.local (one more added with --cache)."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kubealign import tasks
from kubealign.cli import main
from kubealign.cli.summary import route_lines, summarize
from kubealign.config import config_to_json, load_config
from kubealign.config.candidates import MAX_CANDIDATES, Candidate, check_keys, check_names, expand, slug
from kubealign.config.schema import DPOConfig, PPOConfig
from kubealign.errors import UserError
from kubealign.models import loading
from kubealign.pipelines.local import tasks_for
from kubealign.selection import ranking
from kubealign.selection.frontier import pareto_front
from kubealign.stages import compare, promote
from kubealign.stages.promote import ranked
from tests.faults.test_faults_registry import GUARD_FIGURES
from tests.pipelines.test_kfp_local import SHORT as KFP_SHORT
from tests.pipelines.test_routes import evaluation, fake_evaluation, spec_of

SIX = "pipeline.candidates=[{route: dpo, sweep: {dpo.beta: [0.01, 0.05, 0.1, 0.3]}}, {route: ppo}, {route: grpo}]"
SECTIONS = {"ppo": PPOConfig, "dpo": DPOConfig}


# --- candidates: expansion, names, keys ------------------------------------------------------------------


def test_a_sweep_expands_in_grid_order_with_its_fixed_settings() -> None:
    specs = [
        {
            "route": "grpo",
            "name": "g",
            "set": {"ppo.top_k": 5},
            "sweep": {"ppo.kl_coef": [0.1, 0.02], "ppo.temperature": [1, 0.7]},
        },
        {"route": "dpo", "set": {"dpo.beta": 0.2}},
    ]
    got = expand(specs)
    assert [c.name for c in got] == [
        "g-kl-coef-0p1-temperature-1",
        "g-kl-coef-0p1-temperature-0p7",
        "g-kl-coef-0p02-temperature-1",
        "g-kl-coef-0p02-temperature-0p7",
        "dpo",
    ]
    assert got[1].settings == {"ppo.top_k": 5, "ppo.kl_coef": 0.1, "ppo.temperature": 0.7}
    assert got[4] == Candidate("dpo", "dpo", {"dpo.beta": 0.2})
    assert got[2].overrides() == ["ppo.top_k=5", "ppo.kl_coef=0.02", "ppo.temperature=1"]
    assert [slug(v) for v in (1e-05, True, "Big Model", [1, 2])] == ["1e-05", "true", "big-model", "1-2"]


def test_names_unsafe_reserved_repeated_or_another_routes_are_refused() -> None:
    for names, said in (
        (["Dpo"], "'Dpo': use lowercase"),
        (["dpo-"], "'dpo-': use lowercase"),
        (["a" * 41], "at most 40 characters"),
        (["sft"], "'sft' is taken by the DAG's own tasks"),
        (["evaluate-x"], "'evaluate-x' is taken"),
        (["wait-x"], "'wait-x' is taken"),
        (["compare"], "'compare' is taken"),
        (["x", "x"], "'x' is used twice"),
    ):
        with pytest.raises(ValueError, match=said):
            check_names([Candidate(n, "dpo", {}) for n in names])
    with pytest.raises(ValueError, match="'grpo' is another route's"):
        check_names([Candidate("grpo", "ppo", {})])
    check_names([Candidate("a" * 40, "dpo", {}), Candidate("dpo", "dpo", {})])  # the longest, a route's own
    with pytest.raises(ValueError, match=f"{MAX_CANDIDATES + 1} candidates; at most {MAX_CANDIDATES}"):
        check_names([Candidate(f"c{i}", "dpo", {}) for i in range(MAX_CANDIDATES + 1)])


def test_a_setting_outside_the_routes_section_is_named() -> None:
    check_keys(Candidate("p", "rloo", {"ppo.actor_lora.r": 4, "ppo.kl_coef": 0.1}), SECTIONS)
    for candidate, said in (
        (Candidate("d", "dpo", {"ppo.kl_coef": 1}), "setting 'ppo.kl_coef': a dpo candidate sets dpo.<field>"),
        (Candidate("p", "ppo", {"dpo.beta": 1}), "a ppo candidate sets ppo.<field>"),
        (Candidate("d", "dpo", {"dpo": 1}), "setting 'dpo'"),
        (Candidate("d", "dpo", {"dpo.bta": 1}), r"dpo.bta is not a setting of dpo \(no field 'bta'\)"),
        (Candidate("p", "ppo", {"ppo.actor_lora.rank": 4}), "no field 'rank'"),
        (Candidate("g", "grpo", {"ppo.algorithm": "ppo"}), "ppo.algorithm is the candidate's `route`"),
    ):
        with pytest.raises(ValueError, match=said):
            check_keys(candidate, SECTIONS)


def test_candidates_config() -> None:
    config = load_config(None, [SIX, "pipeline.parallelism=2", "pipeline.max_kl=0.5"])
    assert config.candidate_names() == ("dpo-beta-0p01", "dpo-beta-0p05", "dpo-beta-0p1", "dpo-beta-0p3", "ppo", "grpo")
    assert config.routes() == ("dpo", "ppo", "grpo") and config.route() == "dpo" and config.several()
    second = config.for_candidate(config.candidates()[1])
    assert second.dpo.beta == 0.05 and second.candidates() == (Candidate("dpo", "dpo", {}),) and config.dpo.beta == 0.1
    assert config.for_candidate(config.candidates()[5]).ppo.algorithm == "grpo"
    # a candidate without settings or a name: the route at its section's settings, named after it
    assert load_config(None, ["pipeline.candidates=[{route: grpo}, {route: dpo}]"]).candidates() == (
        Candidate("grpo", "grpo", {}),
        Candidate("dpo", "dpo", {}),
    )
    one = load_config(None, ["pipeline.candidates=[{route: grpo, set: {ppo.kl_coef: 0.3}}]"])
    assert not one.several() and one.route() == "grpo"
    for bad, said in (
        (
            "pipeline.candidates=[{route: dpo, set: {dpo.beta: -1}}]",
            "pipeline.candidates: candidate dpo: field 'dpo.beta': Input should be greater than 0",
        ),
        (
            "pipeline.candidates=[{route: rloo, set: {ppo.samples_per_prompt: 1}}]",
            "candidate rloo: field 'ppo': ppo.algorithm rloo needs ppo.samples_per_prompt >= 2",
        ),
        ("pipeline.candidates=[{route: dpo, sweep: {dpo.beta: []}}]", "sweep dpo.beta: no values"),
        ("pipeline.candidates=[]", "pipeline.candidates"),
    ):
        with pytest.raises(UserError, match=said):
            load_config(None, [bad])
    with pytest.raises(UserError, match="pipeline.candidates and pipeline.algorithm"):
        load_config(None, ["pipeline.algorithms=[ppo,dpo]", "pipeline.candidates=[{route: dpo}]"])


def test_an_unknown_setting_is_one_line_and_exit_2(cli, tmp_path: Path) -> None:
    bad = "pipeline.candidates=[{route: dpo, sweep: {dpo.betta: [0.1, 0.2]}}]"
    result = cli("run", "--set", bad, "--output", tmp_path / "r")
    assert result.code == 2 and result.out == ""
    assert result.err.splitlines() == [
        "kubealign: error: preset tiny-cpu: field 'pipeline.candidates' (from --set): candidate dpo-betta-0p1: "
        "dpo.betta is not a setting of dpo (no field 'betta')"
    ]
    assert not (tmp_path / "r").exists()


# --- the frontier and the KL budget ----------------------------------------------------------------------


def test_pareto_front_by_hand() -> None:
    points = {
        "a": (0.1, 0.5),
        "b": (0.2, 0.9),
        "c": (0.3, 0.8),  # b dominates: less KL, more reward
        "d": (0.2, 0.9),  # equal to b: neither dominates the other
        "e": (0.1, 0.4),  # a dominates: same KL, less reward
        "f": (0.5, 1.2),
        "g": (math.inf, 5.0),  # unknown KL: on no front, and dominates nothing
    }
    assert pareto_front(points) == ["a", "b", "d", "f"]
    assert pareto_front({"x": (0.0, 0.0)}) == ["x"] and pareto_front({}) == []


def test_the_kl_budget_excludes_the_best_candidate() -> None:
    evaluations = {
        "dpo-beta-0p01": evaluation(0.75, 1.0, 0.9),  # the best bound, but over the budget
        "dpo-beta-0p1": evaluation(0.50, 0.6, 0.30),
        "ppo": evaluation(0.625, 0.2, 0.40),  # exactly at the budget: within it
        "grpo": evaluation(0.80, 2.0, 0.41),
    }
    order = list(evaluations)
    standings = ranking.rank(evaluations, "win_rate", order, max_kl=0.4)
    assert [(s.candidate, s.rank) for s in standings] == [
        ("ppo", 1),
        ("dpo-beta-0p1", 2),
        ("grpo", 3),
        ("dpo-beta-0p01", 4),
    ]
    assert standings[0].why == "" and standings[1].why == "win_rate_lower_bound 0.5 < ppo's 0.625"
    assert standings[2].why == "kl_to_baseline 0.41 > pipeline.max_kl 0.4"
    assert standings[3].why == "kl_to_baseline 0.9 > pipeline.max_kl 0.4"
    # no budget: the bound alone
    assert [s.candidate for s in ranking.rank(evaluations, "win_rate", order)][:2] == ["grpo", "dpo-beta-0p01"]
    # a missing KL keeps no budget
    unknown = {"x": {"win_rate_lower_bound": 0.9, "candidate_reward_mean": 1.0}, "y": evaluation(0.1, 0.0, 0.1)}
    assert [s.candidate for s in ranking.rank(unknown, "win_rate", ["x", "y"], max_kl=1.0)] == ["y", "x"]


def test_with_no_candidate_within_the_budget_nothing_leads(tmp_path: Path) -> None:
    config = load_config(None, ["tracking.enabled=false", SIX, "pipeline.max_kl=0.05"])
    candidates = config.candidates()[:3]
    metrics = [
        evaluation(b, r, kl, baseline_reward_mean=-1.0)
        for b, r, kl in ((0.5, 0.9, 0.3), (0.4, 0.7, 0.08), (0.6, 0.2, 0.2))
    ]
    evaluations = {c.name: fake_evaluation(tmp_path / c.name, m) for c, m in zip(candidates, metrics, strict=True)}
    result = compare.run(config, candidates, evaluations, tmp_path / "out")
    assert result["leader"] is None and result["metrics"]["over_kl_budget"] == 3.0
    assert result["verdict"] == (
        "no leader: no candidate within pipeline.max_kl 0.05 (the closest, dpo-beta-0p05, has kl_to_baseline "
        "0.08); nothing is promoted"
    )
    assert result["front"] == [
        "dpo-beta-0p05",
        "dpo-beta-0p01",
    ]  # 0p1 (KL 0.2, reward 0.2): 0p05 (0.08, 0.7) dominates it
    table = (tmp_path / "out" / "leaderboard.md").read_text(encoding="utf-8").splitlines()
    assert table[4].startswith("| 1 | dpo-beta-0p1 | dpo | dpo.beta=0.1 | ")
    assert table[4].endswith("|  | kl_to_baseline 0.2 > pipeline.max_kl 0.05 |")
    assert result["verdict"] in (tmp_path / "out" / "frontier.html").read_text(encoding="utf-8")
    # the run's summary says why in one line, under the comparison's
    dirs = {"compare": tmp_path / "out", **{f"evaluate-{name}": path for name, path in evaluations.items()}}
    dirs.update({c.name: tmp_path / "untrained" for c in candidates})
    lines = route_lines({"failed_routes": {}}, dirs)
    assert lines[1] == f"{'':<19}  {result['verdict']}"
    # the name column is as wide as the longest name and one more (dpo-beta-0p05: 13 + 1)
    assert lines[2].startswith(f"1 {'dpo-beta-0p1':<14}{'-':>8}  win-rate 0.50 [0.60, 0.70], reward 0.200 (SFT -1.000)")
    assert lines[2].endswith("; behind: kl_to_baseline 0.2 > pipeline.max_kl 0.05")
    # every promotion then says why in one line, and none leads
    for candidate in candidates:
        standing = ranked(tmp_path / "out", candidate.name)
        assert standing["leader"] is None and standing["verdict"] == result["verdict"]
        assert json.loads(standing["settings"]) == dict(candidate.settings)
    # as the DAG's compare task gets it: config_json without a pipeline section, the budget as its own input
    shared = config_to_json(load_config(None, ["tracking.enabled=false"]))
    listed = [c.as_dict() for c in candidates]
    paths = {name: str(path) for name, path in evaluations.items()}
    assert tasks.compare(shared, [], listed, paths, str(tmp_path / "dag"), 0.05)["verdict"] == result["verdict"]
    assert tasks.compare(shared, [], listed, paths, str(tmp_path / "none"), 0.0)["leader"] == "dpo-beta-0p1"
    # with a budget the best keeps, it leads
    roomy = load_config(None, ["tracking.enabled=false", SIX, "pipeline.max_kl=0.25"])
    kept = compare.run(roomy, candidates, evaluations, tmp_path / "roomy")
    assert kept["leader"] == "dpo-beta-0p1" and kept["verdict"] == "leader: dpo-beta-0p1"
    assert ranked(tmp_path / "roomy", "dpo-beta-0p01")["verdict"] == (
        "not the leader (rank 3): kl_to_baseline 0.3 > pipeline.max_kl 0.25"
    )


# --- the compiled DAG -------------------------------------------------------------------------------------


@pytest.mark.kfp
def test_six_candidates_with_a_bounded_fan_out_compile_and_validate(tmp_path: Path) -> None:
    _, spec = spec_of(tmp_path, [SIX, "pipeline.parallelism=2", "pipeline.max_kl=3.5"])
    tasks = spec.root.dag.tasks
    names = ["dpo-beta-0p01", "dpo-beta-0p05", "dpo-beta-0p1", "dpo-beta-0p3", "ppo", "grpo"]
    waits = {f"wait-{n}" for n in names[2:]}
    expected = {"data-split", "sft", "reward", "compare", *names, *waits}
    expected |= {f"{prefix}-{n}" for n in names for prefix in ("evaluate", "promote")}
    assert set(tasks) == expected
    for number, name in enumerate(names):
        trained = tasks[name]
        settings = trained.inputs.parameters.get("settings")
        if name.startswith("dpo-"):  # its own beta, in its own task's inputs: its own cache key
            beta = float(name.removeprefix("dpo-beta-").replace("p", "."))
            assert json.loads(settings.runtime_value.constant.string_value) == {"dpo.beta": beta}
        else:
            assert settings is None  # a route's default candidate: the task as a settings-free candidate compiles
            assert trained.inputs.parameters["algorithm"].runtime_value.constant.string_value == name
        # candidate i waits for the slot that candidate i - 2's evaluation frees, failed or not
        extra = [f"wait-{name}"] if number >= 2 else []
        upstream = ["data-split", "sft"] if name.startswith("dpo") else ["data-split", "reward", "sft"]
        assert sorted(trained.dependent_tasks) == sorted(upstream + extra)
        if number >= 2:
            slot = tasks[f"wait-{name}"]
            assert list(slot.dependent_tasks) == [f"evaluate-{names[number - 2]}"]
            strategy = slot.trigger_policy.strategy
            assert strategy == slot.trigger_policy.TriggerStrategy.ALL_UPSTREAM_TASKS_COMPLETED
        promoted = tasks[f"promote-{name}"]
        assert promoted.inputs.parameters["candidate_name"].runtime_value.constant.string_value == name
    comparison = tasks["compare"]
    assert {k: v.task_output_artifact.producer_task for k, v in comparison.inputs.artifacts.items()} == {
        f"evaluation_{n}": f"evaluate-{name}" for n, name in enumerate(names, start=1)
    }
    listed = json.loads(comparison.inputs.parameters["candidates"].runtime_value.constant.string_value)
    assert [c["name"] for c in listed] == names and listed[0]["set"] == {"dpo.beta": 0.01}
    assert comparison.inputs.parameters["max_kl"].runtime_value.constant.number_value == 3.5
    # no bound: no waits
    _, free = spec_of(tmp_path / "free", [SIX])
    assert not [t for t in free.root.dag.tasks if t.startswith("wait-")]


def test_task_list_of_a_sweep() -> None:
    config = load_config(
        None,
        [
            "pipeline.candidates=[{route: dpo, sweep: {dpo.beta: [0.1, 0.5]}}, {route: grpo}]",
            "pipeline.parallelism=1",
        ],
    )
    assert tasks_for(config) == (
        "data-split",
        "sft",
        "reward",
        "dpo-beta-0p1",
        "evaluate-dpo-beta-0p1",
        "wait-dpo-beta-0p5",
        "dpo-beta-0p5",
        "evaluate-dpo-beta-0p5",
        "wait-grpo",
        "grpo",
        "evaluate-grpo",
        "compare",
        "promote-dpo-beta-0p1",
        "promote-dpo-beta-0p5",
        "promote-grpo",
    )


# --- through kfp.local ------------------------------------------------------------------------------------


def sweep_args(betas: str, output: Path) -> list[str]:
    candidates = f"pipeline.candidates=[{{route: dpo, sweep: {{dpo.beta: [{betas}]}}}}]"
    sets = [*KFP_SHORT, candidates, "pipeline.parallelism=1"]
    return ["run", *(arg for item in sets for arg in ("--set", item)), "--output", str(output), "--cache"]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[str]]:
    out = tmp_path_factory.mktemp("sweep") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(sweep_args("0.05, 2.0", out)) == 0
    return out, json.loads((out / "run.json").read_text(encoding="utf-8")), printed.getvalue().splitlines()


def read(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "result.json").read_text(encoding="utf-8"))


@pytest.mark.kfp
@pytest.mark.integration
def test_a_two_candidate_sweep_draws_the_frontier_and_promotes_the_leader(sweep_run) -> None:
    out, index, printed = sweep_run
    names = ["dpo-beta-0p05", "dpo-beta-2p0"]
    assert index["succeeded"] and index["algorithms"] == names and index["failed_routes"] == {}
    assert index["candidates"][1] == {"name": "dpo-beta-2p0", "route": "dpo", "set": {"dpo.beta": 2.0}}
    comparison = read(index["stages"]["compare"]["dir"])
    metrics = {n: read(index["stages"][f"evaluate-{n}"]["dir"])["metrics"] for n in names}
    expected = ranking.rank(metrics, "win_rate", names)
    assert [s["candidate"] for s in comparison["standings"]] == [s.candidate for s in expected]
    leader = expected[0].candidate
    assert comparison["leader"] == leader
    points = {n: (metrics[n]["kl_to_baseline"], metrics[n]["candidate_reward_mean"]) for n in names}
    assert comparison["front"] == pareto_front(points)
    # the KFP UI's artifacts, and the picture in the comparison's directory
    task_dir = Path(index["stages"]["compare"]["dir"]).parent
    assert f"| 1 | {leader} | dpo | dpo.beta=" in (task_dir / "leaderboard").read_text(encoding="utf-8")
    assert "data:image/png;base64," in (task_dir / "report").read_text(encoding="utf-8")
    assert (Path(index["stages"]["compare"]["dir"]) / "frontier.png").stat().st_size > 10_000
    # the registry: only the leader moved the aliases; each version tagged with its candidate and settings
    client = MlflowClient(index["mlflow"]["tracking_uri"])
    for name in names:
        version = client.get_model_version(
            "kubealign-actor", str(read(index["stages"][f"promote-{name}"]["dir"])["version"])
        )
        assert version.tags["kubealign.candidate"] == name and version.tags["kubealign.leader"] == leader
        assert json.loads(version.tags["kubealign.settings"]) == {"dpo.beta": 2.0 if name.endswith("2p0") else 0.05}
    champion = client.get_model_version_by_alias("kubealign-actor", "champion")
    assert champion.tags["kubealign.candidate"] == leader
    # MLflow: one nested run per candidate under the pipeline's run, its settings as params
    parent = index["mlflow"]["parent_run_id"]
    runs = client.search_runs(
        [client.get_run(parent).info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent}' and tags.`kubealign.stage` = 'candidate'",
    )
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == set(names)
    # each candidate trained with its own beta: its dpo stage's run (found by the model it wrote) logged it
    stage_runs = client.search_runs(
        [client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'"
    )
    trained = {r.data.tags.get("kubealign.model_dir"): r.data.params.get("dpo.beta") for r in stage_runs}
    assert [trained[index["stages"][name]["dir"]] for name in names] == ["0.05", "2.0"]
    assert by_name["dpo-beta-2p0"].data.params == {"algorithm": "dpo", "dpo.beta": "2.0"}
    assert by_name[leader].data.metrics["rank"] == 1.0
    assert by_name[leader].data.metrics["kl_to_baseline"] == metrics[leader]["kl_to_baseline"]
    assert "frontier.png" in [a.path for a in client.list_artifacts(parent)]
    # the closing summary: one line per candidate
    ranked_lines = [line for line in printed if line[:2] in ("1 ", "2 ")]
    assert ranked_lines[0].split()[:2] == ["1", leader]
    assert "wait-dpo-beta-2p0" in [line.split()[0] for line in printed[: printed.index("")]]
    assert any(line.startswith(f"1 {leader}") for line in summarize(out))


@pytest.mark.kfp
@pytest.mark.integration
def test_one_more_candidate_with_cache_trains_only_it(sweep_run, tmp_path: Path, capsys) -> None:
    _, index, _ = sweep_run
    assert main(sweep_args("0.05, 2.0, 0.5", tmp_path / "more")) == 0
    printed = capsys.readouterr().out.splitlines()
    ran = {line.split()[0] for line in printed[: printed.index("")] if line.split()[1] == "running"}
    # the new candidate, the comparison and the promotions (never cached); the wait tasks are no-ops
    assert ran - {"wait-dpo-beta-2p0", "wait-dpo-beta-0p5"} == {
        "dpo-beta-0p5",
        "evaluate-dpo-beta-0p5",
        "compare",
        "promote-dpo-beta-0p05",
        "promote-dpo-beta-2p0",
        "promote-dpo-beta-0p5",
    }
    second = json.loads((tmp_path / "more" / "run.json").read_text(encoding="utf-8"))
    for task in ("data-split", "sft", "reward", "dpo-beta-0p05", "evaluate-dpo-beta-0p05", "dpo-beta-2p0"):
        assert second["stages"][task]["dir"] == index["stages"][task]["dir"], task
    standings = read(second["stages"]["compare"]["dir"])["standings"]
    assert {s["candidate"] for s in standings} == {"dpo-beta-0p05", "dpo-beta-2p0", "dpo-beta-0p5"}


@pytest.mark.kfp
def test_one_candidate_compiles_to_the_one_route_dag_with_its_settings_on_its_task(tmp_path: Path) -> None:
    _, plain = spec_of(tmp_path / "plain", ["pipeline.candidates=[{route: dpo}]"])
    _, one = spec_of(tmp_path / "one", ["pipeline.candidates=[{route: dpo, set: {dpo.beta: 0.3}}]"])
    defaults = {k: v.default_value for k, v in one.root.input_definitions.parameters.items()}
    # the shared tasks' inputs (config_json and the rest) are a plain dpo run's: their cache stays valid
    assert defaults == {k: v.default_value for k, v in plain.root.input_definitions.parameters.items()}
    assert json.loads(defaults["config_json"].string_value)["dpo"]["beta"] == 0.1
    branches = {name: task for name, task in one.components.items() if name.startswith("comp-condition")}
    dpo_task = next(t.dag.tasks["dpo"] for t in branches.values() if "dpo" in t.dag.tasks)
    ppo_task = next(t.dag.tasks["ppo"] for t in branches.values() if "ppo" in t.dag.tasks)
    assert json.loads(dpo_task.inputs.parameters["settings"].runtime_value.constant.string_value) == {"dpo.beta": 0.3}
    assert "settings" not in ppo_task.inputs.parameters


@pytest.mark.kfp
@pytest.mark.integration
def test_rerun_one_candidate_trains_it_with_its_settings(sweep_run, tmp_path: Path) -> None:
    out, index, _ = sweep_run
    target = tmp_path / "again"
    assert main(["rerun", "dpo-beta-2p0", "--from", str(out), "--output", str(target)]) == 0
    new = json.loads((target / "run.json").read_text(encoding="utf-8"))
    assert new["rerun"] == [
        "dpo-beta-2p0",
        "evaluate-dpo-beta-2p0",
        "compare",
        "promote-dpo-beta-0p05",
        "promote-dpo-beta-2p0",
    ]
    assert read(target / "compare")["evaluations"]["dpo-beta-0p05"] == index["stages"]["evaluate-dpo-beta-0p05"]["dir"]
    client = MlflowClient(new["mlflow"]["tracking_uri"])
    parent = new["mlflow"]["parent_run_id"]
    runs = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    trained = {r.data.tags.get("kubealign.model_dir"): r.data.params.get("dpo.beta") for r in runs}
    assert trained[str(target / "dpo-beta-2p0")] == "2.0"


@pytest.mark.integration
def test_over_the_budget_no_promotion_moves_an_alias(tmp_path: Path) -> None:
    """A real (sqlite) registry: with no candidate within pipeline.max_kl, the first-ranked one is registered
    like the others and moves no alias; with a budget the second keeps, that one (alone) moves them."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lenient = ["promote.min_win_rate=0", "promote.min_reward_gain=-100", "promote.max_kl=100"]
    lenient.append("promote.min_win_rate_lower_bound=null")
    candidates = load_config(None, [SIX]).candidates()[:2]
    metrics = [evaluation(0.6, 0.9, 0.3), evaluation(0.4, 0.7, 0.08)]
    evals = {}
    for candidate, m in zip(candidates, metrics, strict=True):
        m.update({"reward_gain": m["candidate_reward_mean"] + 1, "baseline_reward_mean": -1.0, **GUARD_FIGURES})
        evals[candidate.name] = fake_evaluation(tmp_path / candidate.name, m)
    model = Path(loading.resolve("tiny-opt"))
    for budget, champion in ((0.05, None), (0.1, "dpo-beta-0p05")):
        config = load_config(None, [SIX, f"pipeline.max_kl={budget}", f"tracking.uri={uri}", *lenient])
        comparison = tmp_path / f"compare-{budget}"
        compare.run(config, candidates, evals, comparison)
        held = {}
        for candidate in candidates:  # the first-ranked (dpo-beta-0p01, the better bound) goes first
            out = tmp_path / f"promote-{budget}-{candidate.name}"
            result = promote.run(config, evals[candidate.name], model, out, comparison, candidate.name)
            held[candidate.name] = result["version"] in result["aliases"].values()  # champion or challenger
        assert [name for name, holds in held.items() if holds] == ([champion] if champion else [])
