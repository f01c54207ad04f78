"""The one percentile rule, the bootstrap interval of a median over rounds, and the verdict rule:
met only when the interval's lower end clears the goal, missed when its upper end does not reach
it, undecided otherwise or on too few rounds."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from benchmarks.harness.stats import (
    Goal,
    bootstrap_interval,
    decided,
    judge,
    paired_differences,
    percentile,
    spread,
)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 95, 99, 100])
def test_percentile_is_numpys_linear_rule(q):
    values = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0, 11.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_nothing_and_out_of_range_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError, match="got 101"):
        percentile([1.0], 101)


def test_the_interval_holds_the_median_and_is_repeatable():
    rounds = [1.18, 1.25, 1.22, 1.31, 1.20, 1.27]
    low, high = bootstrap_interval(rounds)
    assert min(rounds) <= low <= statistics.median(rounds) <= high <= max(rounds)
    assert bootstrap_interval(list(reversed(rounds))) == (low, high)  # the same rounds, same answer


def test_spread_records_every_round():
    summary = spread([2.0, 1.0, 3.0, 4.0, 5.0])
    assert summary["median"] == 3.0 and summary["rounds"] == [2.0, 1.0, 3.0, 4.0, 5.0]
    assert summary["min"] == 1.0 and summary["max"] == 5.0
    assert summary["low"] <= 3.0 <= summary["high"]


def test_met_only_when_the_lower_end_clears_the_goal():
    assert judge([1.30, 1.32, 1.35, 1.31, 1.33], Goal(1.2)).verdict == "met"
    # the median clears 1.2 but a round misses it: the interval's lower end does not clear it
    straddling = judge([1.15, 1.25, 1.22, 1.30, 1.19, 1.27], Goal(1.2))
    assert straddling.verdict == "undecided"
    assert straddling.rounds_met == 4 and straddling.rounds == 6
    assert "met in 4 of 6 rounds" in str(straddling)


def test_missed_when_the_upper_end_does_not_reach_it():
    assert judge([0.91, 0.95, 0.93, 0.97, 0.92], Goal(1.0)).verdict == "missed"


def test_an_upper_bound_goal_reads_the_other_end():
    assert judge([1.02, 1.05, 1.04, 1.03, 1.06], Goal(1.1, at_least=False)).verdict == "met"
    assert judge([1.22, 1.25, 1.24, 1.23, 1.26], Goal(1.1, at_least=False)).verdict == "missed"


def test_too_few_rounds_decide_nothing():
    judged = judge([2.5, 2.6], Goal(2.0))
    assert judged.verdict == "undecided" and "2 rounds kept" in str(judged)


def test_a_paired_decision_needs_its_interval_on_one_side_of_zero():
    a = [45, 40, 38, 50, 44, 41]
    assert decided(paired_differences(a, [30, 28, 31, 33, 29, 30])) == "a"
    assert decided(paired_differences(a, [44, 42, 37, 51, 43, 40])) == "undecided"
    assert decided(paired_differences(a[:3], [0, 0, 0])) == "undecided"  # too few draws
    with pytest.raises(ValueError, match="count"):
        paired_differences(a, [1.0])
