"""The verifiable-rewards demo: the synthetic-arithmetic generator and the checker shipped with its preset."""

from __future__ import annotations

import importlib.util
import random
import re

import pytest

from kubealign.config import load_config
from kubealign.config.schema import DataConfig, DataSource
from kubealign.data import arithmetic
from kubealign.data.schemas import normalize
from kubealign.data.sources import declared_columns, read_source
from kubealign.data.split import split_rows
from kubealign.errors import UserError
from kubealign.usercode import definitions
from tests.conftest import REPO

QUESTION = re.compile(r"Human: (.*)\n\nAssistant:$", re.S)


def _checker():
    spec = importlib.util.spec_from_file_location("arithmetic_reward", REPO / "configs" / "rewards" / "arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.exact_answer


def _sum_in(prompt: str) -> int:
    """a + b recomputed from the prompt's question text (independently of arithmetic.operands)."""
    question = QUESTION.search(prompt).group(1)
    return sum(int(d) for d in re.findall(r"\d", question))


def test_pure_function_of_the_seed():
    assert arithmetic.generate(40, 60, seed=3) == arithmetic.generate(40, 60, seed=3)
    assert arithmetic.generate(40, 60, seed=3) != arithmetic.generate(40, 60, seed=4)


def test_demonstrations_then_prompts_each_with_its_own_text():
    rows = arithmetic.generate(70, 130, seed=0)
    assert [set(r) for r in rows] == [{"prompt", "response"}] * 130 + [{"prompt", "answer"}] * 70
    assert len({r["prompt"] for r in rows}) == 200  # no text shared: split would drop a shared prompt-only row


@pytest.mark.parametrize("sft_rows", [1, 7, 130, 1000])
def test_share_of_right_demonstrations_is_the_configured_one(sft_rows: int):
    demos = arithmetic.generate(0, sft_rows, seed=5)
    right = sum(int(r["response"]) == _sum_in(r["prompt"]) for r in demos)
    assert right == round(arithmetic.RIGHT_SHARE * sft_rows)


def test_wrong_demonstrations_copy_an_operand():
    for row in arithmetic.generate(0, 400, seed=2):
        a, b = (int(d) for d in re.findall(r"\d", QUESTION.search(row["prompt"]).group(1)))
        answer = int(row["response"])
        assert row["response"] == f" {answer}"
        assert answer == a + b or answer in (a, b) or (a, b, answer) == (0, 0, 1)
    assert {arithmetic.wrong_sum(random.Random(s), 0, 4) for s in range(20)} == {0}  # 4 is the sum: not copied
    assert {arithmetic.wrong_sum(random.Random(s), 3, 5) for s in range(20)} == {3, 5}
    assert arithmetic.wrong_sum(random.Random(0), 0, 0) == 1


def test_prompt_rows_carry_the_right_answer():
    rows = arithmetic.generate(300, 0, seed=9)
    for row in rows:
        assert row["answer"] == _sum_in(row["prompt"]) <= 9
        assert arithmetic.operands(row["prompt"]) is not None
    assert {r["answer"] for r in rows} == set(range(10))  # every sum occurs


def test_capacity_is_checked():
    with pytest.raises(UserError, match="synthetic_prompts"):
        arithmetic.generate(arithmetic.CAPACITY, 1, seed=0)


def test_source_and_split_send_prompt_rows_to_phase3_only():
    data = DataConfig(sources=[DataSource(path="synthetic-arithmetic")], synthetic_sft_rows=40, synthetic_prompts=20)
    read = read_source(0, data.sources[0], data)
    assert (read.label, read.kind, len(read.records)) == ("synthetic-arithmetic", "synthetic", 60)
    assert read.records[0].origin == "synthetic-arithmetic:row 1"
    rows = []
    for record in read.records:
        pair = normalize(record.value, columns=declared_columns(data.sources[0]))  # answer: the built-in's column
        rows.append(
            {
                "prompt": pair.prompt,
                "chosen": pair.chosen,
                "rejected": pair.rejected,
                "columns": pair.columns,
                "source": "s",
                "origin": record.origin,
            }
        )
    plan = split_rows(rows, (2, 4, 4), 0.1, seed=0)
    assert plan.dropped == []
    phase1, phase3 = plan.phases["phase1_sft"], plan.phases["phase3_prompts"]
    assert len(phase1["train"]) + len(phase1["eval"]) == 40
    assert all(r["chosen"] is None for split in phase3.values() for r in split)
    assert len(phase3["train"]) + len(phase3["eval"]) == 20


def test_checker_on_hand_made_completions():
    exact_answer = _checker()
    prompts = ["p"] * 6
    completions = [" 7", " 7 ", " 8", "", "7\n\nHuman:", " 7"]
    answers = [7, 7, 7, 7, 7, None]
    assert exact_answer(prompts, completions, answer=answers, other=[0] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, None]


def test_preset_resolves_the_shipped_checker():
    config = load_config("tiny-cpu-verifiable")
    (spec,) = definitions.resolve(config.rewards, config.base_dir)
    assert spec.name == "exact_answer" and "def exact_answer" in spec.source
    assert config.rewards.model_weight == 0 and not config.rewards.uses_model
    assert config.promote.metric == f"fn/{spec.name}/candidate"
    assert config.route() == config.ppo.algorithm == "grpo"  # the stage commands run what the DAG runs
