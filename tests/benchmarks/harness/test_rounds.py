"""Paired rounds: every side once per round, the order alternating (A B, B A) or rotating, the
warm-up dropped, the ratio taken within each round."""

from __future__ import annotations

import pytest

from benchmarks.harness.rounds import order_of, paired_rounds, ratio_rounds, summarize


def test_two_sides_alternate_and_more_rotate():
    assert [order_of(["a", "b"], i) for i in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    firsts = [order_of(["a", "b", "c"], i)[0] for i in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_the_warmup_is_dropped_and_ratios_pair_within_a_round():
    calls: list[str] = []
    clock = iter(range(100))

    def side(name: str, scale: float):
        def measure() -> float:
            calls.append(name)
            return scale * (20 + next(clock))  # the machine "drifts": later calls are larger

        return measure

    kept = paired_rounds({"ours": side("ours", 2.0), "theirs": side("theirs", 1.0)}, 5, warmup=1)
    assert calls[:4] == ["ours", "theirs", "theirs", "ours"]
    assert len(kept["ours"]) == len(kept["theirs"]) == 5
    ratios = ratio_rounds(kept, "ours", "theirs")
    assert all(1.8 < r < 2.2 for r in ratios)  # near 2 despite the drift, round by round
    summary = summarize(kept, "ours", "theirs")
    assert summary["ratio"]["rounds"] == [round(r, 3) for r in ratios]


def test_rounds_must_be_positive():
    with pytest.raises(ValueError):
        paired_rounds({"a": lambda: 1.0}, 0)
