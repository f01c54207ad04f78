"""A row's mask is given up past its CPU budget, or past MASK_WALL_FACTOR budgets of wall time:
a row that only waits (for a core, on a busy machine) is not failed at its budget."""

from __future__ import annotations

import time

import torch

from engine.mask_pool import MASK_WALL_FACTOR, MaskPool

BUDGET_S = 0.02


class Waiting:
    """A matcher whose mask takes ``seconds`` of wall time and almost no CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def unsafe_compute_mask_ptr(self, trg_ptr: int, trg_bytes: int) -> None:
        time.sleep(self.seconds)


class Burning:
    """A matcher whose mask spins the CPU for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def unsafe_compute_mask_ptr(self, trg_ptr: int, trg_bytes: int) -> None:
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass


def _finish(matchers) -> list[str | None]:
    bitmask = torch.zeros(len(matchers), 4, dtype=torch.int32)
    return MaskPool().start(bitmask, matchers).finish(BUDGET_S)


def test_a_row_that_waits_past_its_budget_but_uses_no_cpu_is_kept():
    assert _finish([Waiting(3 * BUDGET_S)]) == [None]


def test_a_row_past_its_cpu_budget_is_given_up_and_the_others_kept():
    why = _finish([Burning(20 * BUDGET_S), Waiting(0.0)])
    assert why[0] is not None and "took over 20 ms" in why[0] and why[1] is None


def test_a_row_past_the_wall_bound_is_given_up_however_little_cpu_it_used():
    started = time.monotonic()
    why = _finish([Waiting(20 * MASK_WALL_FACTOR * BUDGET_S)])
    waited = time.monotonic() - started
    assert why[0] is not None
    # given up at its wall bound, long before the mask would end (the margin: a loaded machine)
    assert MASK_WALL_FACTOR * BUDGET_S <= waited < 10 * MASK_WALL_FACTOR * BUDGET_S
