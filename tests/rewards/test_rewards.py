"""Reward functions as code (verifiable rewards): the config, the specs with embedded source, the worker's
checks of every bad input, the scorer's arithmetic, prompt-only rows, the promote.metric gate, the DAG's
cache keys, and the whole DAG without a reward model through kfp.local."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kubealign.config import load_config
from kubealign.config.schema import KubealignConfig, PromoteConfig, RewardsConfig
from kubealign.data import phases
from kubealign.data.schemas import Pair, normalize
from kubealign.data.split import split_rows
from kubealign.errors import UserError
from kubealign.promotion.gate import gate
from kubealign.rewards.scorer import Scorer, combine, completions_of
from kubealign.rewards.totals import function_totals
from kubealign.usercode import definitions
from kubealign.usercode.runner import FunctionRunner
from tests.selection.test_gate import NO_GUARDS

FUNCTIONS = """
import time

def exact(prompts, completions, answer, **columns):
    return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]

def length(prompts, completions, **columns):
    return [len(c) for c in completions]

def one_argument(completions):
    return [0.0] * len(completions)

def raises_on_short(prompts, completions, **columns):
    return [1.0 / (len(c) - 2) for c in completions]

def hangs(prompts, completions, **columns):
    time.sleep(60)

def nan_on_second(prompts, completions, **columns):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]

def one_value(prompts, completions, **columns):
    return [1.0]

def text_value(prompts, completions, **columns):
    return ["high"] * len(completions)

def not_a_list(prompts, completions, **columns):
    return 3.0

def is_right(prompts, completions, **columns):
    return [c == "right" for c in completions]

NOT_CALLABLE = 3
"""


@pytest.fixture
def fns(tmp_path: Path) -> Path:
    (tmp_path / "fns.py").write_text(FUNCTIONS, encoding="utf-8")
    return tmp_path


def runner_for(directory: Path, name: str, timeout_s: float = 10.0) -> FunctionRunner:
    rewards = RewardsConfig(functions=[{"path": f"fns.py:{name}"}], timeout_s=timeout_s)
    return FunctionRunner(definitions.resolve(rewards, str(directory)), timeout_s)


ORIGINS = ["d.jsonl:3", "d.jsonl:7", "d.jsonl:9"]


def call(directory: Path, name: str, completions: list[str], columns=None, timeout_s: float = 10.0):
    with runner_for(directory, name, timeout_s) as runner:
        n = len(completions)
        return runner.call(runner.specs[0], ["p"] * n, completions, columns or {}, ORIGINS[:n])


# --- the score ---------------------------------------------------------------------------------------


def test_combine_weights_the_model_and_each_function_and_none_adds_nothing():
    model = [1.0, -2.0, 0.5]
    values = [[1.0, None, 0.0], [None, 3.0, 1.0]]
    # 0.5 * model + 2 * f1 - 1 * f2, a None adding 0
    assert combine(model, 0.5, values, [2.0, -1.0]) == pytest.approx([2.5, -4.0, -0.75])
    assert combine(None, 0.5, values, [2.0, -1.0]) == pytest.approx([2.0, -3.0, -1.0])  # functions alone
    assert combine(model, 2.0, [], []) == pytest.approx([2.0, -4.0, 1.0])


class CharTokenizer:
    """id = character code; 0 is the EOS (special)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_completions_are_the_response_tokens_through_the_eos_without_it():
    a, b, x = ord("a"), ord("b"), ord("x")
    # row 0: left pad (0), prompt "x", response "ab" + EOS, then padding after the EOS
    # row 1: prompt "x" + an EOS inside the prompt + "x", response "b" (cut, no EOS)
    ids = torch.tensor([[0, x, a, b, 0, 0], [x, 0, x, b, b, b]])
    response_mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]])  # action t made token t + 1
    assert completions_of(CharTokenizer(), ids, response_mask) == ["ab", "b"]


def test_scorer_adds_the_weighted_functions_to_the_reward_model(fns: Path):
    from tests.rl.test_experience import TokenValue  # value at position t: 10 * token + t

    ids = torch.tensor([[5, ord("r"), 0], [5, ord("w"), 0]])
    attention = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the RM scores the last real token: 0 at 2, 119 at 1
    response = torch.tensor([[1, 1], [1, 0]])
    rows = phases.Rows(["p", "p"], {"answer": ["r", None]}, ORIGINS[:2])
    rewards = RewardsConfig(
        functions=[{"path": "fns.py:exact", "weight": 3.0}, {"path": "fns.py:length", "weight": -0.5}]
    )
    with FunctionRunner(definitions.resolve(rewards, str(fns)), 10) as runner:
        scorer = Scorer(TokenValue(), 0.5, runner, CharTokenizer())
        scores, values = scorer.score(ids, attention, response, rows)
        assert values == {"exact": [1.0, None], "length": [1.0, 1.0]}
        # 0.5 * (10 * 0 + 2) + 3 * 1 - 0.5 * 1 ; 0.5 * (10 * 119 + 1) + 0 - 0.5 * 1
        assert scores == pytest.approx([1.0 + 3.0 - 0.5, 595.5 - 0.5])
        # the None left out of exact's mean
        assert function_totals(values) == {"exact": (1.0, 1), "length": (2.0, 2)}
        assert scorer(ids, attention, response, rows).tolist() == pytest.approx(scores)


def test_booleans_count_as_one_and_zero(fns: Path):
    assert call(fns, "is_right", ["right", "wrong"]) == [1.0, 0.0]


# --- bad input: one line naming the function and, where it applies, the row ------------------------------


@pytest.mark.parametrize(
    ("name", "completions", "columns", "expected"),
    [
        ("missing", ["a"], None, "rewards.functions[0].path: fns.py has no function missing"),
        ("NOT_CALLABLE", ["a"], None, "NOT_CALLABLE in fns.py is a int, not a function"),
        (
            "one_argument",
            ["a"],
            None,
            "one_argument(completions) cannot be called as one_argument(prompts, completions",
        ),
        (
            "exact",
            ["a"],
            {"other": [1]},
            "reward function exact (rewards.functions[0].path): cannot take the columns ['other']",
        ),
        (
            "raises_on_short",
            ["abc", "ab", "x"],
            None,
            "raises_on_short (rewards.functions[0].path): raised ZeroDivisionError: float division by zero (fns.py, line 14) on row d.jsonl:7",
        ),
        (
            "nan_on_second",
            ["a", "b"],
            None,
            "nan_on_second (rewards.functions[0].path): returned nan for row d.jsonl:7; a reward must be finite",
        ),
        ("one_value", ["a", "b"], None, "returned 1 values for 2 completions"),
        ("text_value", ["a", "b"], None, "returned 'high' (str), expected a float or None for row d.jsonl:3"),
        ("not_a_list", ["a"], None, "returned a float, expected a list of floats or None"),
    ],
)
def test_every_bad_function_is_one_line_naming_it(fns: Path, name, completions, columns, expected):
    with pytest.raises(UserError) as info:
        call(fns, name, completions, columns)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_a_hanging_function_is_stopped_by_the_timeout(fns: Path):
    runner = runner_for(fns, "hangs", timeout_s=1.0)
    with (
        runner,
        pytest.raises(
            UserError,
            match=r"hangs .*no answer within rewards.timeout_s 1 s \(a batch of 2 rows starting at d.jsonl:3\)",
        ),
    ):
        runner.call(runner.specs[0], ["p", "p"], ["a", "b"], {}, ORIGINS[:2])
    assert runner.process is None  # the worker was killed, not left sleeping


def test_a_file_that_does_not_load_names_its_error_and_line(tmp_path: Path):
    (tmp_path / "bad.py").write_text("def f(prompts, completions):\n    return [\n", encoding="utf-8")
    rewards = RewardsConfig(functions=[{"path": "bad.py:f"}])
    with pytest.raises(UserError, match=r"rewards.functions\[0\].path: cannot load bad.py: SyntaxError"):
        FunctionRunner(definitions.resolve(rewards, str(tmp_path)), 10).start()


def test_missing_file_is_named_with_the_directory_it_was_looked_for_in(tmp_path: Path):
    rewards = RewardsConfig(functions=[{"path": "x.py:f"}, {"path": "nope/y.py:g"}])
    (tmp_path / "x.py").write_text("def f(p, c): return []\n", encoding="utf-8")
    with pytest.raises(
        UserError, match=rf"rewards.functions\[1\].path: no such file: nope/y.py \(relative to {tmp_path}\)"
    ):
        definitions.resolve(rewards, str(tmp_path))


def test_the_function_prints_do_not_break_the_protocol(tmp_path: Path, capfd):
    (tmp_path / "loud.py").write_text("def f(p, c, **k):\n    print('[1.0]')\n    return [2.0] * len(c)\n", "utf-8")
    rewards = RewardsConfig(functions=[{"path": "loud.py:f"}])
    with FunctionRunner(definitions.resolve(rewards, str(tmp_path)), 10) as runner:
        assert runner.call(runner.specs[0], ["p"], ["a"], {}, ["o"]) == [2.0]
    assert "[1.0]" in capfd.readouterr().err


# --- config and specs ------------------------------------------------------------------------------------


def test_relative_function_files_are_relative_to_the_config_file(tmp_path: Path, fns: Path):
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "c.yaml"
    config.write_text(yaml.safe_dump({"rewards": {"functions": [{"path": "../fns.py:exact", "weight": 2}]}}), "utf-8")
    loaded = load_config(config)
    (spec,) = definitions.resolve(loaded.rewards, loaded.base_dir)
    assert (spec.name, spec.weight, spec.source) == ("exact", 2.0, FUNCTIONS)
    assert definitions.from_json(definitions.to_json([spec])) == [spec]


def test_a_module_function_travels_by_name_with_its_modules_hash():
    rewards = RewardsConfig(functions=[{"path": "kubealign.rewards.scorer:combine"}])
    (spec,) = definitions.resolve(rewards, None)
    assert spec.source is None
    scorer_file = Path(__file__).parents[2] / "kubealign" / "rewards" / "scorer.py"
    import hashlib

    assert spec.sha256 == hashlib.sha256(scorer_file.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ({"functions": [{"path": "f.py"}]}, "expected FILE.py:NAME or module:NAME"),
        ({"functions": [{"path": "a.py:f"}, {"path": "b.py:f"}]}, "two reward functions named 'f'"),
        ({"model_weight": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_rewards_sections_name_the_field(cli, tmp_path: Path, rewards, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"rewards": rewards}), encoding="utf-8")
    result = cli("config", "show", "--config", config)
    assert result.code == 2 and message in result.err and "field 'rewards" in result.err


def test_the_reward_model_is_used_unless_functions_alone_are_asked_for():
    assert RewardsConfig().uses_model
    assert RewardsConfig(model_weight=0).uses_model  # no functions: the reward model is all there is
    assert RewardsConfig(functions=[{"path": "f.py:g"}]).uses_model
    assert not RewardsConfig(functions=[{"path": "f.py:g"}], model_weight=0).uses_model


def test_specs_that_do_not_match_the_config_are_refused(fns: Path):
    rewards = RewardsConfig(functions=[{"path": "fns.py:exact"}])
    specs = definitions.resolve(rewards, str(fns))
    definitions.check_matches(specs, rewards)
    with pytest.raises(UserError, match="does not match rewards.functions"):
        definitions.check_matches(specs, RewardsConfig(functions=[{"path": "fns.py:exact", "weight": 2}]))


# --- prompt-only rows ----------------------------------------------------------------------------------


def test_a_prompt_only_row_keeps_its_other_fields_as_columns():
    pair = normalize({"prompt": "2+2?", "answer": "4", "level": 1}, columns=frozenset({"answer"}))
    assert pair == Pair("2+2?", None, None, '{"answer": "4", "level": 1}')
    assert normalize({"prompt": "2+2?", "level": 1}) == Pair("2+2?", None, None, '{"level": 1}')  # nothing to declare


def test_prompt_only_rows_go_to_phase_3_and_nowhere_else():
    def row(prompt, chosen=None, rejected=None, columns=None):
        return {
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "columns": columns,
            "source": "s",
            "origin": f"f:{prompt}",
        }

    rows = [row(f"pref{i}", "c", "r") for i in range(10)]
    rows += [row(f"q{i}", columns=json.dumps({"answer": str(i)})) for i in range(6)]
    rows += [row("sft", "demo"), row("sft", columns='{"answer": "x"}')]  # a prompt with a demonstration too
    plan = split_rows(rows, (1, 1, 1), 0.5, seed=3)
    where = {p: ph for ph, splits in plan.phases.items() for s in splits.values() for p in (r["prompt"] for r in s)}
    assert all(where[f"q{i}"] == "phase3_prompts" for i in range(6))
    assert where["sft"] == "phase1_sft"
    assert [(reason, r["origin"]) for reason, r in plan.dropped] == [("prompt_only_outside_phase3", "f:sft")]
    phase1 = plan.phases["phase1_sft"]["train"] + plan.phases["phase1_sft"]["eval"]
    assert all(r["chosen"] is not None for r in phase1)
    assert plan.prompts["phase3_prompts"]["train"] + plan.prompts["phase3_prompts"]["eval"] == 6 + 3


def test_prompt_rows_give_the_union_of_columns_with_none_where_a_row_lacks_one():
    import datasets

    split = datasets.Dataset.from_dict(
        {
            "prompt": ["a", "b", "a", "c"],
            "columns": ['{"answer": "1"}', None, '{"answer": "9"}', '{"unit": "m"}'],
            "origin": ["f:1", "f:2", "f:3", "f:4"],
        }
    )
    rows = phases.prompt_rows(split)
    assert rows.prompts == ["a", "b", "c"]  # a repeated prompt once, at its first row
    assert rows.columns == {"answer": ["1", None, None], "unit": [None, None, "m"]}
    assert rows.origins == ["f:1", "f:2", "f:4"]
    assert rows.take([2, 0]).repeat(2).prompts == ["c", "c", "a", "a"]


# --- promote.metric --------------------------------------------------------------------------------------

EVALUATION = {
    "win_rate": 0.2,
    "reward_gain": 0.3,
    "kl_to_baseline": 1.0,
    "candidate_reward_mean": 0.7,
    "fn/exact/baseline": 0.4,
    "fn/exact/candidate": 0.7,
}


def test_promote_metric_replaces_the_win_rate_checks():
    assert not gate(EVALUATION, PromoteConfig(), None)[0]  # win-rate 0.2 < 0.5
    cfg = PromoteConfig(metric="fn/exact/candidate", min_metric=0.6, guards=NO_GUARDS)  # the reward checks alone
    passed, checks = gate(EVALUATION, cfg, None)
    assert passed, checks
    assert checks == [
        "pass: reward_gain: needs >= 0.0, got 0.300",
        "pass: fn/exact/candidate: needs >= 0.6, got 0.700",
        "pass: fn/exact/candidate: needs > 0.400 (the baseline's), got 0.700",
    ]
    assert not gate({**EVALUATION, "fn/exact/candidate": 0.4}, PromoteConfig(metric="fn/exact/candidate"), None)[0]
    assert not gate(EVALUATION, cfg.model_copy(update={"min_metric": 0.71}), None)[0]


def test_promote_metric_against_the_champion():
    cfg = PromoteConfig(metric="fn/exact/candidate", guards=NO_GUARDS)
    champion = {"candidate_reward_mean": 9.0, "fn/exact/candidate": 0.75}
    passed, checks = gate(EVALUATION, cfg, champion)
    assert not passed and checks[-1] == "FAIL: fn/exact/candidate: needs > 0.750 (the champion's), got 0.700"
    passed, checks = gate(EVALUATION, cfg, {**champion, "fn/exact/candidate": float("nan")})
    assert passed and checks[-1] == "pass: fn/exact/candidate: the champion has none recorded, not compared"


def test_promote_metric_the_evaluation_lacks_is_an_error():
    with pytest.raises(
        UserError,
        match=r"promote.metric fn/other/candidate: the evaluation has no such metric \(fn/exact/baseline, fn/exact/candidate\)",
    ):
        gate(EVALUATION, PromoteConfig(metric="fn/other/candidate"), None)
    with pytest.raises(ValueError, match="the win-rate's is min_win_rate"):
        PromoteConfig(min_metric=0.5)


# --- the DAG: the source in the compiled pipeline, in the cache keys of ppo and evaluate only ------------


def compiled(config: KubealignConfig, path: Path) -> dict:
    from kfp import compiler

    from kubealign.pipelines.dag import build

    compiler.Compiler().compile(build(config), str(path))
    return next(yaml.safe_load_all(path.read_text(encoding="utf-8")))  # then the kubernetes platform spec


def reading(ir: dict, parameter: str) -> set[str]:
    """The DAG's tasks that take the pipeline parameter `parameter` (their cache keys include it)."""
    tasks = ir["root"]["dag"]["tasks"]
    found = set()

    def walk(dag_tasks: dict) -> None:
        for name, task in dag_tasks.items():
            sub = ir["components"][task["componentRef"]["name"]].get("dag")
            if sub:  # a condition branch only hands parameters on to its tasks
                walk(sub["tasks"])
                continue
            wanted = (parameter, f"pipelinechannel--{parameter}")
            params = task.get("inputs", {}).get("parameters", {}).values()
            if any(p.get("componentInputParameter") in wanted for p in params):
                found.add(name)

    walk(tasks)
    return found


def test_the_function_source_is_embedded_and_keys_only_ppo_and_evaluate(tmp_path: Path, fns: Path):
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump({"rewards": {"model_weight": 0, "functions": [{"path": "fns.py:exact"}]}}), "utf-8"
    )
    config = load_config(config.rename(fns / "c.yaml"))
    first = compiled(config, tmp_path / "a.yaml")
    default = first["root"]["inputDefinitions"]["parameters"]["reward_functions"]["defaultValue"]
    assert json.loads(default)[0]["source"] == FUNCTIONS  # in the pipeline: the image need not have it
    assert reading(first, "reward_functions") == {"ppo", "evaluate"}
    assert "reward" not in first["root"]["dag"]["tasks"]  # no reward model: no reward task
    assert "reward" not in first["root"]["outputDefinitions"]["artifacts"]
    (fns / "fns.py").write_text(FUNCTIONS + "\n# edited\n", encoding="utf-8")
    second = compiled(config, tmp_path / "b.yaml")
    changed = second["root"]["inputDefinitions"]["parameters"]["reward_functions"]["defaultValue"]
    assert changed != default
    # every other parameter, config_json included, is as it was: the other tasks keep their cache keys
    for name, definition in first["root"]["inputDefinitions"]["parameters"].items():
        if name != "reward_functions":
            assert second["root"]["inputDefinitions"]["parameters"][name] == definition, name


def test_with_a_reward_model_the_dag_keeps_its_reward_task(fns: Path, tmp_path: Path):
    ir = compiled(load_config(), tmp_path / "p.yaml")
    assert "reward" in ir["root"]["dag"]["tasks"] and "reward" in ir["root"]["outputDefinitions"]["artifacts"]


# --- the whole DAG through kfp.local, scored by a function alone -----------------------------------------

CHECK = """
def short(prompts, completions, **columns):
    # a checkable property: the response is at most 12 characters
    return [float(len(c.strip()) <= 12) for c in completions]
"""


@pytest.mark.kfp
@pytest.mark.integration
def test_the_dag_without_a_reward_model_and_an_edited_function_reruns_only_ppo_and_evaluate(tmp_path: Path, capsys):
    from kubealign.cli import main

    (tmp_path / "check.py").write_text(CHECK, encoding="utf-8")
    config = tmp_path / "c.yaml"
    settings = {
        "pipeline": {"candidates": [{"route": "grpo"}]},
        "rewards": {"model_weight": 0, "functions": [{"path": "check.py:short"}]},
        "sft": {"num_train_epochs": 1},  # what is run again and what is cached matters here, not quality
        "ppo": {"num_iterations": 1, "generation_batch_size": 4},
        "evaluate": {"max_prompts": 4},
        "promote": {"metric": "fn/short/candidate", "min_reward_gain": -100},
    }
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["run", "--config", str(config), "--output", str(first), "--cache"]) == 0
    capsys.readouterr()
    index = json.loads((first / "run.json").read_text(encoding="utf-8"))
    assert sorted(index["stages"]) == ["data-split", "evaluate", "ppo", "promote", "sft"]  # no reward task
    metrics = json.loads((Path(index["stages"]["evaluate"]["dir"]) / "result.json").read_text())["metrics"]
    assert {"fn/short/baseline", "fn/short/candidate"} <= set(metrics)
    gate_lines = json.loads((Path(index["stages"]["promote"]["dir"]) / "result.json").read_text())["gate"]
    assert any("fn/short/candidate" in line for line in gate_lines) and not any("win_rate" in g for g in gate_lines)

    (tmp_path / "check.py").write_text(CHECK + "# edited: only the tasks that score run again\n", encoding="utf-8")
    assert main(["run", "--config", str(config), "--output", str(second), "--cache"]) == 0
    printed = capsys.readouterr().out.splitlines()
    shown = sorted(" ".join(line.split()[:2]) for line in printed[: printed.index("")])
    assert shown == sorted(
        ["data-split cached", "sft cached"]
        + [f"{s} {w}" for s in ("ppo", "evaluate", "promote") for w in ("running", "done")]
    )
    again = json.loads((second / "run.json").read_text(encoding="utf-8"))
    for stage in ("data-split", "sft"):
        assert again["stages"][stage]["dir"] == index["stages"][stage]["dir"], stage
    for stage in ("ppo", "evaluate"):
        assert again["stages"][stage]["dir"] != index["stages"][stage]["dir"], stage
    assert "# edited" in json.loads(again["reward_functions"])[0]["source"]

    # a rerun repeats the run: the functions' code as that run embedded it, not the file as it is now
    rerun = tmp_path / "rerun"
    assert main(["rerun", "evaluate", "--from", str(first), "--output", str(rerun)]) == 0
    assert "# edited" not in json.loads(json.loads((rerun / "run.json").read_text())["reward_functions"])[0]["source"]
    assert (rerun / "evaluate" / "result.json").is_file()
