"""evaluate's statistics (kubealign.selection.comparison) by hand: every metric of compare on rows where each one has its
own value, both ends of the bootstrap interval, and reward functions' None in every mean."""

from __future__ import annotations

import math

import pytest

from kubealign.selection.comparison import bootstrap_interval, compare, function_means_by_model, repetition_rate


def rows(scores, tokens, fns=None):
    fns = fns or [{}] * len(scores)
    return [{"score": s, "tokens": t, "fn": f} for s, t, f in zip(scores, tokens, fns, strict=True)]


def test_every_metric_of_compare_by_hand():
    # five prompts: the candidate wins 0 and 3, ties 1 (within 1e-6), loses 2 and 4
    base = rows([0.0, 1.0, 2.0, -1.0, 0.5], [[1, 2], [1, 2, 1, 2], [7], [1, 1, 1], [3, 4, 5, 6, 7, 8]])
    cand = rows([0.5, 1.0 + 5e-7, 1.0, 0.0, 0.25], [[1, 2, 3], [9, 9], [4, 5, 4, 5], [2], [1, 2]])
    m = compare(base, cand, seed=0)
    assert (m["win_rate"], m["tie_rate"], m["loss_rate"], m["prompts"]) == (0.4, 0.2, 0.4, 5)
    assert m["baseline_reward_mean"] == pytest.approx(2.5 / 5)
    assert m["candidate_reward_mean"] == pytest.approx((0.5 + 1.0000005 + 1.0 + 0.0 + 0.25) / 5)
    assert m["reward_gain"] == pytest.approx(m["candidate_reward_mean"] - 0.5)
    # lengths: baseline 2 4 1 3 6 -> sorted 1 2 3 4 6; candidate 3 2 4 1 2 -> sorted 1 2 2 3 4
    assert (m["baseline_length_mean"], m["baseline_length_median"], m["baseline_length_max"]) == (16 / 5, 3.0, 6.0)
    assert (m["candidate_length_mean"], m["candidate_length_median"], m["candidate_length_max"]) == (12 / 5, 2.0, 4.0)
    assert m["length_drift"] == pytest.approx((12 / 5) / (16 / 5))
    # repeated bigrams: baseline [1,2,1,2] 1/3, [1,1,1] 1/2, the others 0; candidate [4,5,4,5] 1/3, [9,9] 0
    assert m["baseline_repetition_rate"] == pytest.approx((1 / 3 + 1 / 2) / 5)
    assert m["candidate_repetition_rate"] == pytest.approx((1 / 3) / 5)
    low, high = bootstrap_interval([1.0, 0.0, 0.0, 1.0, 0.0], 0)
    assert (m["win_rate_lower_bound"], m["win_rate_upper_bound"]) == (low, high)
    assert low < 0.4 < high


def test_the_median_of_an_even_count_is_the_upper_middle():
    m = compare(rows([0.0] * 4, [[1], [1, 1], [1] * 3, [1] * 10]), rows([0.0] * 4, [[1]] * 4))
    assert m["baseline_length_median"] == 3.0 and m["candidate_length_median"] == 1.0 and m["tie_rate"] == 1.0


def test_repetition_rate_by_hand():
    assert repetition_rate([1, 2, 1, 2]) == pytest.approx(1 / 3)  # (1,2) (2,1) (1,2): one repeat of three
    assert repetition_rate([3, 3, 3, 3]) == pytest.approx(2 / 3)
    assert repetition_rate([1, 2, 3]) == 0.0 and repetition_rate([5]) == 0.0 and repetition_rate([]) == 0.0


def test_both_ends_of_the_bootstrap_interval():
    assert bootstrap_interval([1.0] * 40, seed=0) == (1.0, 1.0)
    assert bootstrap_interval([0.0] * 40, seed=0) == (0.0, 0.0)
    assert bootstrap_interval([], seed=0) == (0.0, 0.0)
    # 30 wins of 60: the normal approximation gives 0.5 -+ 1.96 * sqrt(0.25 / 60) = 0.373 and 0.627
    half = [1.0, 0.0] * 30
    low, high = bootstrap_interval(half, seed=0)
    margin = 1.96 * math.sqrt(0.25 / 60)
    assert low == pytest.approx(0.5 - margin, abs=0.025) and high == pytest.approx(0.5 + margin, abs=0.025)
    # 15 wins of 60 (0.25): an asymmetric one, 0.25 -+ 1.96 * sqrt(0.25 * 0.75 / 60) = 0.140 and 0.360
    quarter = [1.0, 0.0, 0.0, 0.0] * 15
    low, high = bootstrap_interval(quarter, seed=0)
    margin = 1.96 * math.sqrt(0.25 * 0.75 / 60)
    assert low == pytest.approx(0.25 - margin, abs=0.025) and high == pytest.approx(0.25 + margin, abs=0.025)
    narrow, wide = bootstrap_interval(half, 0, level=0.8), bootstrap_interval(half, 0, level=0.99)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    assert bootstrap_interval(half, seed=0) == bootstrap_interval(half, seed=0)  # seeded


def test_function_means_leave_out_none_in_each_model():
    base = rows(
        [0.0] * 3, [[1]] * 3, [{"exact": 1.0, "len": None}, {"exact": None, "len": None}, {"exact": 0.0, "len": None}]
    )
    cand = rows(
        [0.0] * 3, [[1]] * 3, [{"exact": 1.0, "len": 4.0}, {"exact": 1.0, "len": None}, {"exact": None, "len": 2.0}]
    )
    assert function_means_by_model(base, cand) == {
        "fn/exact/baseline": 0.5,  # 1 and 0; the None left out, not counted as 0 (that would be 1/3)
        "fn/exact/candidate": 1.0,
        "fn/len/candidate": 3.0,  # len applies to none of the baseline's rows: no metric
    }
    assert function_means_by_model([], []) == {}


def test_repetition_counts_pairs_not_single_tokens():
    assert repetition_rate([1, 1, 2, 2]) == 0.0  # (1,1) (1,2) (2,2): no pair twice, though tokens repeat


def test_the_interval_is_seeded_and_its_ends_are_the_level_s_quantiles():
    """Continuous outcomes (a grid on [0, 1], 200 of them), so the bootstrap means are not stuck on a lattice:
    the normal approximation 0.5 -+ z * sd / sqrt(n) with z = 0.674 for a 50 % interval (quantiles 0.25 and
    0.75) holds to a few thousandths at 2000 resamples."""
    grid = [i / 199 for i in range(200)]
    sd = math.sqrt(sum((x - 0.5) ** 2 for x in grid) / 200) / math.sqrt(200)
    low, high = bootstrap_interval(grid, seed=0, level=0.5)
    assert low == pytest.approx(0.5 - 0.6745 * sd, abs=0.002) and high == pytest.approx(0.5 + 0.6745 * sd, abs=0.002)
    assert bootstrap_interval(grid, seed=0) == bootstrap_interval(grid, seed=0, resamples=2000)  # the default count
    assert bootstrap_interval(grid, seed=0) == bootstrap_interval(grid, seed=0)  # the seed fixes every draw
    assert bootstrap_interval(grid, seed=0) != bootstrap_interval(grid, seed=1)


def test_compare_edges():
    # a difference of exactly 1e-6 is a tie, not a win; a baseline shorter than one token on average still
    # gives the drift as a plain ratio
    m = compare(rows([0.0, 0.0], [[], [1]]), rows([1e-6, -1.0], [[1], [1]]))
    assert (m["win_rate"], m["tie_rate"], m["loss_rate"]) == (0.0, 0.5, 0.5)
    assert m["length_drift"] == pytest.approx(1.0 / 0.5)
    assert (m["win_rate_lower_bound"], m["win_rate_upper_bound"]) == (0.0, 0.0)  # the tie is no win here either
    assert compare(rows([0.0, 1.0], [[1], [1]]), rows([1.0, 0.0], [[1], [1]])) == compare(
        rows([0.0, 1.0], [[1], [1]]), rows([1.0, 0.0], [[1], [1]]), seed=0
    )  # the default seed is 0
    with pytest.raises(ValueError):  # the two models answered different prompt lists
        compare(rows([0.0, 1.0], [[1], [1]]), rows([0.0], [[1]]))


def test_function_means_of_one_row_and_of_rows_without_functions():
    assert function_means_by_model(rows([0.0], [[1]], [{"f": 2.0}]), rows([0.0], [[1]], [{"f": None}])) == {
        "fn/f/baseline": 2.0
    }
    assert function_means_by_model([{"score": 0.0, "tokens": [1]}], [{"score": 0.0, "tokens": [1]}]) == {}
