"""Paired, interleaved rounds: every side measured once per round, back to back, the order
rotating from round to round (A B, B A, … for two sides; each side first in turn for more), the
first ``warmup`` rounds dropped. The ratio of a round is taken between its own measurements, so a
machine that drifts between rounds moves both sides of a round together."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from benchmarks.harness.stats import spread

DEFAULT_ROUNDS = 5  # kept rounds
DEFAULT_WARMUP = 1


def order_of(names: list[str], index: int) -> list[str]:
    """The sides in the order round ``index`` measures them: with two sides A B, B A, A B, …;
    with more, rotated by one each round, so every side goes first as often as every other."""
    if len(names) == 2:
        return names if index % 2 == 0 else names[::-1]
    shift = index % len(names)
    return names[shift:] + names[:shift]


def paired_rounds(
    sides: Mapping[str, Callable[[], float]],
    rounds: int = DEFAULT_ROUNDS,
    warmup: int = DEFAULT_WARMUP,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, list[float]]:
    """Each side's value in each of ``rounds`` kept rounds (after ``warmup`` dropped ones).
    ``on_round(index, values)`` sees every kept round as it ends (for progress lines)."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    names = list(sides)
    kept: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        values = {name: sides[name]() for name in order_of(names, index)}
        if index < warmup:
            continue
        for name in names:
            kept[name].append(values[name])
        if on_round is not None:
            on_round(index - warmup, values)
    return kept


def ratio_rounds(kept: Mapping[str, list[float]], ours: str, theirs: str) -> list[float]:
    """``ours / theirs`` round by round."""
    return [a / b for a, b in zip(kept[ours], kept[theirs], strict=True)]


def summarize(
    kept: Mapping[str, list[float]], ours: str, theirs: str, digits: int = 2
) -> dict[str, Any]:
    """Each side's spread and the per-round ratio's, under ``ratio``."""
    summary: dict[str, Any] = {name: spread(values, digits) for name, values in kept.items()}
    summary["ratio"] = spread(ratio_rounds(kept, ours, theirs), 3)
    return summary
