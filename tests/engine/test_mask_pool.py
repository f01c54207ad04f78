"""A row's mask is given up past its CPU budget, or past MASK_WALL_LIMIT_S of wall time: a row
that only waits (for a core on a busy machine, for the interpreter's lock) is waited for, even
well past its budget, and not failed."""

from __future__ import annotations

import time

import torch

from engine import mask_pool
from engine.mask_pool import MaskPool

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


def test_a_row_that_waits_well_past_its_budget_but_uses_no_cpu_is_kept():
    assert _finish([Waiting(3 * BUDGET_S)]) == [None]
    # 15 budgets of waiting (a loaded machine's stall) is still the machine's fault, not the
    # grammar's: its request is not failed for it
    assert _finish([Waiting(15 * BUDGET_S), Waiting(0.0)]) == [None, None]


def test_a_row_past_its_cpu_budget_is_given_up_and_the_others_kept():
    why = _finish([Burning(20 * BUDGET_S), Waiting(0.0)])
    assert why[0] is not None and "took over 20 ms of CPU" in why[0] and why[1] is None


def test_a_row_past_the_wall_bound_is_given_up_however_little_cpu_it_used(monkeypatch):
    limit = 0.5  # the bound itself (2 s) shortened, so the test waits less
    monkeypatch.setattr(mask_pool, "MASK_WALL_LIMIT_S", limit)
    started = time.monotonic()
    why = _finish([Waiting(8 * limit)])
    waited = time.monotonic() - started
    assert why[0] is not None and "held over 0.5 s" in why[0]
    # given up at its wall bound, long before the mask would end (the margin: a loaded machine)
    assert limit <= waited < 4 * limit
