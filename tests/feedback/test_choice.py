"""Which served pairs people are asked about (issue 79): each judge's probability, the pair's priority, the two
strata of a round's budget and the weights that keep the human win-rate unbiased. Pure; figures by hand."""

from __future__ import annotations

import math
import random

import pytest

from kubealign.feedback import choice

pytestmark = pytest.mark.unit


def test_each_judge_says_how_likely_the_canary_is_better():
    got = choice.canary_probabilities({"reward": (1.0, 3.0), "heldout": (2.0, 2.0)}, "champion")
    # Bradley-Terry: sigmoid(canary - champion); equal scores: 0.5; the LLM judge's verdict: 0 for the champion
    assert got == {"reward": pytest.approx(1 / (1 + math.exp(-2))), "heldout": 0.5, "llm_judge": 0.0}
    assert choice.canary_probabilities({"reward": (3.0, 1.0)}, None) == {"reward": pytest.approx(0.11920292)}
    assert choice.canary_probabilities({}, "tie") == {"llm_judge": 0.5}
    assert choice.canary_probabilities({}, "canary") == {"llm_judge": 1.0}
    assert choice.sigmoid(-800.0) == 0.0 and choice.sigmoid(800.0) == 1.0  # no overflow either way


def test_priority_is_how_far_apart_the_judges_are_or_how_unsure_a_lone_one_is():
    assert choice.priority({"reward": 0.9, "llm_judge": 0.1}) == pytest.approx(0.8)  # they split
    assert choice.priority({"reward": 1.0, "heldout": 0.0, "llm_judge": 0.5}) == 1.0  # sure of opposite sides
    assert choice.priority({"reward": 0.9, "heldout": 0.7}) == pytest.approx(0.2)  # the same side, apart by 0.2
    assert choice.priority({"heldout": 0.3, "reward": 0.9, "llm_judge": 0.6}) == pytest.approx(0.6)  # max - min
    # both unsure and alike: nothing tells them apart (the mean near 0.5 ranked this first)
    assert choice.priority({"reward": 0.52, "heldout": 0.48}) == pytest.approx(0.04)
    assert choice.priority({"reward": 1.0, "llm_judge": 1.0}) == 0.0  # agree and sure: nothing to learn
    assert choice.priority({"reward": 0.5}) == 1.0  # one judge: how unsure it is
    assert choice.priority({"reward": 0.9}) == pytest.approx(4 * 0.9 * 0.1)  # 0.36
    assert choice.priority({"llm_judge": 0.0}) == 0.0
    assert choice.priority({}) == 1.0  # nobody voted: ask


def test_the_budget_takes_the_highest_priorities_then_a_random_sample_of_the_rest():
    priorities = [0.1, 0.9, 0.5, 0.9, 0.0, 0.3]
    chosen = choice.choose(priorities, budget=4, random_share=0.5, seed=3)
    # 4 - round(4 * 0.5) = 2 certain: the two 0.9s (the earlier first); 2 drawn from the 4 left, each standing for 2
    assert chosen[:2] == [choice.Chosen(1, "disagreement", 1.0), choice.Chosen(3, "disagreement", 1.0)]
    drawn = chosen[2:]
    assert [c.stratum for c in drawn] == ["random", "random"] and [c.weight for c in drawn] == [2.0, 2.0]
    assert {c.index for c in drawn} < {0, 2, 4, 5} and drawn == sorted(drawn)
    assert sum(c.weight for c in chosen) == len(priorities)  # the weights stand for every served pair
    assert choice.choose(priorities, 4, 0.5, 3) == chosen  # seeded
    draws = {tuple(c.index for c in choice.choose(priorities, 4, 0.5, seed)[2:]) for seed in range(40)}
    assert len(draws) > 3  # the seed moves the random part


def test_the_budget_at_its_edges():
    p = [0.2, 0.8, 0.4]
    assert choice.choose(p, 10, 0.25, 0) == [  # more budget than pairs: all of them, each standing for itself
        choice.Chosen(1, "disagreement", 1.0),
        choice.Chosen(2, "disagreement", 1.0),  # 3 - round(0.75) = 2 certain
        choice.Chosen(0, "random", 1.0),
    ]
    assert [c.index for c in choice.choose(p, 2, 0.0, 0)] == [1, 2]  # no random share: priorities only
    everything_random = choice.choose(p, 2, 1.0, 0)
    assert [c.stratum for c in everything_random] == ["random"] * 2 and everything_random[0].weight == 1.5
    assert choice.choose(p, 0, 0.5, 0) == [] and choice.choose([], 5, 0.5, 0) == []
    with pytest.raises(ValueError, match="random_share 1.5"):
        choice.choose(p, 2, 1.5, 0)


def test_the_weighted_win_rate_is_unbiased_where_the_chosen_share_is_not():
    """People agree with nobody in particular: the challenger wins exactly the pairs where the judges were sure
    (low priority) and loses the disputed ones. Asking where judges disagree then sees mostly losses; the weights
    put the population's rate back, on average over the random draws (its expectation is exact: the weights sum
    to the number of pairs whatever is drawn)."""
    rng = random.Random(0)
    priorities = [rng.random() for _ in range(60)]
    wins = [p < 0.5 for p in priorities]
    truth = sum(wins) / len(wins)
    weighted, plain = [], []
    for seed in range(3000):
        chosen = choice.choose(priorities, 12, 0.5, seed)
        weighted.append(choice.weighted_rate([(wins[c.index], c.weight) for c in chosen]))
        plain.append(sum(wins[c.index] for c in chosen) / len(chosen))
    assert sum(weighted) / len(weighted) == pytest.approx(truth, abs=0.01)
    assert sum(plain) / len(plain) < truth - 0.1  # unweighted: biased towards the disputed pairs' losses


def test_weighted_rate_by_hand():
    assert choice.weighted_rate([(True, 1.0), (False, 1.0), (True, 2.0)]) == 0.75
    assert choice.weighted_rate([(False, 3.0), (True, 1.0)]) == 0.25
    assert math.isnan(choice.weighted_rate([]))


def test_a_canary_that_fools_every_judge_still_meets_people_through_the_random_share():
    """Adversary: the canary's answers fool both reward models (both sure it is better) on 30 pairs people give to
    the champion; on 10 the judges split and people prefer the canary. Asked about 10 pairs only where the judges
    disagree (random_share 0), people see the 10 and the canary wins them all. With a random share, the 30 are seen through
    the random draws, each standing for the pairs left: by hand, budget 12 at 0.25 takes 9 of the 10 split pairs for
    certain and draws 3 of the 31 left, each standing for 31 / 3; the canary's weighted rate is 9 / 40 when no split
    pair is drawn, (9 + 31 / 3) / 40 when the tenth is: below 0.5 either way, 0.25 on average."""
    judged = [{"reward": 0.99, "heldout": 0.98}] * 30 + [{"reward": 0.9, "heldout": 0.1}] * 10
    canary_won = [False] * 30 + [True] * 10
    priorities = [choice.priority(p) for p in judged]

    def rate(chosen: list[choice.Chosen]) -> float:
        return choice.weighted_rate([(canary_won[c.index], c.weight) for c in chosen])

    only = choice.choose(priorities, 10, 0.0, 0)
    assert {c.index for c in only} == set(range(30, 40)) and rate(only) == 1.0  # fooled with the judges
    assert rate(choice.choose(priorities, 12, 0.0, 0)) == pytest.approx(10 / 12)  # 2 fooled pairs, standing alone
    rates = [rate(choice.choose(priorities, 12, 0.25, seed)) for seed in range(2000)]
    assert sorted({round(r, 9) for r in rates}) == [round(9 / 40, 9), round((9 + 31 / 3) / 40, 9)]
    assert sum(rates) / len(rates) == pytest.approx(0.25, abs=0.01)
