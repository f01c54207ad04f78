"""The statistics every benchmark reports with: one percentile rule, a round's spread, the
bootstrap interval of a median over rounds, and the verdict a goal gets from that interval.

A performance claim is a ratio taken within each round (two sides measured back to back on the
same machine state), summarized over the kept rounds by its median and a percentile-bootstrap
interval of that median. A goal is **met** only when the interval's lower end clears it, **missed**
when its upper end does not reach it, and **undecided** otherwise; the report also says in how many
single rounds the goal held.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

CONFIDENCE = 0.95
RESAMPLES = 4000
MIN_KEPT_ROUNDS = 5  # the fewest kept rounds a verdict other than "undecided" may rest on

Verdict = Literal["met", "missed", "undecided"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks (numpy's
    default rule); the one rule of every benchmark."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def bootstrap_interval(
    values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES
) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of ``values``. Seeded by the values
    themselves, so the same rounds always give the same interval (a report re-rendered from its
    JSON does not move)."""
    if not values:
        raise ValueError("an interval of no values")
    rng = random.Random(repr(sorted(values)))
    n = len(values)
    medians = [statistics.median(rng.choices(values, k=n)) for _ in range(resamples)]
    tail = (1 - confidence) / 2 * 100
    return percentile(medians, tail), percentile(medians, 100 - tail)


def spread(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """Median, bootstrap interval, min and max over rounds, and the rounds themselves."""
    low, high = bootstrap_interval(values)
    return {
        "median": round(statistics.median(values), digits),
        "low": round(low, digits),
        "high": round(high, digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "rounds": [round(v, digits) for v in values],
    }


@dataclass(frozen=True)
class Goal:
    """A bound a ratio should clear: ``ratio >= value`` (``at_least``) or ``ratio <= value``."""

    value: float
    at_least: bool = True

    def holds(self, ratio: float) -> bool:
        return ratio >= self.value if self.at_least else ratio <= self.value

    def __str__(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.value:g}x"


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    rounds_met: int
    rounds: int
    why: str = ""

    def __str__(self) -> str:
        text = f"{self.verdict} (met in {self.rounds_met} of {self.rounds} rounds)"
        return f"{text}; {self.why}" if self.why else text


def judge(rounds: Sequence[float], goal: Goal) -> Judgement:
    """The verdict of per-round ratios against ``goal``: met when the interval's lower end clears
    it (its upper end for an upper bound), missed when the other end does not, undecided otherwise
    and whenever fewer than :data:`MIN_KEPT_ROUNDS` rounds were kept."""
    met = sum(goal.holds(r) for r in rounds)
    if len(rounds) < MIN_KEPT_ROUNDS:
        return Judgement("undecided", met, len(rounds), f"{len(rounds)} rounds kept")
    low, high = bootstrap_interval(rounds)
    near, far = (low, high) if goal.at_least else (high, low)
    if goal.holds(near):
        return Judgement("met", met, len(rounds))
    if not goal.holds(far):
        return Judgement("missed", met, len(rounds))
    return Judgement("undecided", met, len(rounds))


def paired_differences(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """``a - b`` per draw (the same draw served by two configurations), with the bootstrap
    interval of their median: the figure a keep/delete decision between the two rests on."""
    if len(a) != len(b):
        raise ValueError(f"paired measures differ in count: {len(a)} and {len(b)}")
    return spread([x - y for x, y in zip(a, b, strict=True)])


def decided(difference: dict[str, Any]) -> Literal["a", "b", "undecided"]:
    """Which side a paired difference favours: only when its whole interval lies on one side of
    zero (and enough draws were kept)."""
    if len(difference["rounds"]) < MIN_KEPT_ROUNDS:
        return "undecided"
    if difference["low"] > 0:
        return "a"
    if difference["high"] < 0:
        return "b"
    return "undecided"
