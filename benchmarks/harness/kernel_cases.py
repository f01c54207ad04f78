"""Kernel-by-kernel comparisons of two sides: every case (a kind, a weight shape, a row count)
timed on each side in every round, the sides back to back and the first alternating
(``benchmarks.harness.rounds``), then per case each side's spread and one side's speed-up over
the other (the other's time over its own) judged against a goal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.harness.rounds import DEFAULT_WARMUP, order_of
from benchmarks.harness.stats import Goal, judge, spread

# (name, kind, activations [rows, k], weight blocks)
KernelCase = tuple[str, str, torch.Tensor, torch.Tensor]
# (side, case, products) -> microseconds per product on that side
TimeSide = Callable[[str, KernelCase, int], float]


def micros_per_call(call: Callable[[], object], n: int) -> float:
    """Microseconds per ``call()`` over ``n`` of them, after one untimed call."""
    call()
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


def kernel_rounds(
    cases: Sequence[KernelCase],
    sides: Sequence[str],
    time_side: TimeSide,
    rounds: int,
    repeats: Callable[[int], int],
) -> dict[str, dict[str, list[float]]]:
    """Each case's microseconds per product on each side, every kept round (``DEFAULT_WARMUP``
    rounds dropped first). ``repeats(rows)``: products timed per side of a case."""
    kept: dict[str, dict[str, list[float]]] = {case[0]: {s: [] for s in sides} for case in cases}
    for index in range(DEFAULT_WARMUP + rounds):
        for case in cases:
            n = repeats(case[2].shape[0])
            for side in order_of(list(sides), index):
                micros = time_side(side, case, n)
                if index >= DEFAULT_WARMUP:
                    kept[case[0]][side].append(micros)
        print(f"round {index + 1 - DEFAULT_WARMUP} done", flush=True)
    return kept


def speedup_cases(
    kept: dict[str, dict[str, list[float]]], faster: str, slower: str, goal: Goal
) -> dict[str, dict[str, Any]]:
    """Per case: ``<faster>_us``, ``<slower>_us``, ``<faster>_speedup`` (the slower side's time
    over the faster side's, round by round) and its verdict against ``goal``."""
    result: dict[str, dict[str, Any]] = {}
    for name, sides in kept.items():
        speedups = [s / f for f, s in zip(sides[faster], sides[slower], strict=True)]
        verdict = judge(speedups, goal)
        result[name] = {
            f"{faster}_us": spread(sides[faster], 1),
            f"{slower}_us": spread(sides[slower], 1),
            f"{faster}_speedup": spread(speedups, 3),
            "verdict": verdict.verdict,
        }
        median = result[name][f"{faster}_speedup"]["median"]
        print(f"{name}: {faster} speed-up {median}x, {verdict}")
    return result
