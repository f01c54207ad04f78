"""The borrower's side of core sharing (workers/core_sharing.py): before each step, the
threads of every idle lender, and of a busy one yielding to this worker, are added to its own."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch

from workers.core_sharing import (
    BUSY,
    CLAIM_SEQ,
    CLOSED,
    DONE_SEQ,
    GRANT,
    GRANT_UNIT_S,
    HANDOFF_HOLD_S,
    IDLE,
    OPEN,
    OPEN_NOW,
    POLL_S,
    RECHECK_MISSING_S,
    STATE,
    THREADS,
    UNYIELDED_STEP_S,
    WANTS,
    YIELD_SEQ,
    YIELD_WAIT_S,
    YIELDED_STEP_FRACTION,
    YIELDING,
    read_state,
)


@dataclass
class _Lending:
    path: str
    fd: int | None = None
    next_try: float = 0.0
    held_until: float = 0.0  # counts as busy until then (a hand-off went its way)
    seen_busy: bool = False
    wants: bool | None = None  # as last written to the file (None: not yet, so the first is)
    running_yield: int = 0  # the yield this step runs in (0: none)
    granted_s: float = 0.0  # and the pause the lender granted for it

    def read(self, now: float) -> bytes | None:
        if self.fd is None:
            if now < self.next_try:
                return None
            self.next_try = now + RECHECK_MISSING_S
            try:
                self.fd = os.open(self.path, os.O_RDWR)
            except OSError:
                return None
        return read_state(self.fd)

    def write(self, offset: int, value: int) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.pwrite(self.fd, bytes((value,)), offset)

    def lent_threads(self, now: float) -> int:
        """Threads lent for the next step: all of an idle lender's, or of one yielding to us."""
        state = self.read(now)
        if state is None:
            return 0
        if state[STATE] == YIELDING:
            seq = state[YIELD_SEQ]
            if seq != state[DONE_SEQ] and self.wants and self._claim(seq):
                self.running_yield, self.granted_s = seq, state[GRANT] * GRANT_UNIT_S
                return state[THREADS]
            self.seen_busy = True
            return 0
        if state[STATE] != IDLE:
            self.seen_busy = True
            return 0
        if self.held(now):
            return 0
        return state[THREADS]

    def held(self, now: float) -> bool:
        """A hand-off went its way lately, and it has not been seen busy since."""
        return now < self.held_until and not self.seen_busy

    def _claim(self, seq: int) -> bool:
        """Claim yield ``seq``; False (and released) if the lender withdrew it meanwhile."""
        self.write(CLAIM_SEQ, seq)
        state = self.read(time.monotonic())
        if state is not None and state[STATE] == YIELDING and state[YIELD_SEQ] == seq:
            return True
        self.write(DONE_SEQ, seq)
        return False

    def step_done(self) -> None:
        if self.running_yield:
            self.write(DONE_SEQ, self.running_yield)
            self.running_yield = 0

    def set_wants(self, wants: bool, now: float) -> None:
        if self.fd is None:
            self.read(now)  # opens the file, if it is there yet
        if wants != self.wants and self.fd is not None:
            self.write(WANTS, int(wants))
            self.wants = wants

    def yield_to_come(self, now: float) -> int | None:
        """For a lender busy, or ending a yield we ran a step in, that may yield: when
        (``OPEN_NOW``: at its next step, ``DEFERRED``: later). None for any other lender, one
        that says it will not yield for a while among them."""
        state = self.read(now)
        if state is None or state[OPEN] == CLOSED:
            return None
        ending = state[STATE] == YIELDING and state[YIELD_SEQ] == state[DONE_SEQ]
        return state[OPEN] if state[STATE] == BUSY or ending else None


@dataclass
class Borrower:
    """The threads to run this step: ``own`` plus those of every idle lender, and of every
    lender yielding to a step of ours."""

    own: int
    paths: tuple[str, ...]
    _lendings: list[_Lending] = field(init=False)
    threads: int = field(init=False)
    num_borrowing_steps: int = 0
    num_yielded_steps: int = 0
    # a long prompt runs this step on its own threads, more may come soon: a lender may yield,
    # or one held for a hand-off may turn out idle
    more_threads_soon: bool = False

    def __post_init__(self) -> None:
        self._lendings = [_Lending(path) for path in self.paths]
        self.threads = self.own

    def update(self, wants_yield: bool = False) -> int:
        """Engine thread, before a step: set torch's thread count; returns it. ``wants_yield``:
        ask busy lenders to yield (a long prompt waits), and wait a little for one to."""
        self.step_done()
        now = time.monotonic()
        for lending in self._lendings:
            lending.set_wants(wants_yield, now)
        if wants_yield:
            self._wait_for_a_yield(now)
            now = time.monotonic()
        threads = self.own + sum(lending.lent_threads(now) for lending in self._lendings)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self.num_borrowing_steps += threads > self.own
        self.num_yielded_steps += self.in_a_yield
        self.more_threads_soon = (
            wants_yield
            and threads == self.own
            and any(
                lending.held(now) or lending.yield_to_come(now) is not None
                for lending in self._lendings
            )
        )
        return threads

    def step_limit_s(self, yield_s: float) -> float | None:
        """How long the next step may take (None: no limit): one run in a yield fits the pause
        granted (at most ``yield_s``, ``decode_yield_ms``), with room to spare; one on its own
        threads while more may come soon ends soon, for them to find it between two steps."""
        grants = [lending.granted_s for lending in self._lendings if lending.running_yield]
        if grants:
            return min(yield_s, *grants) * YIELDED_STEP_FRACTION
        return UNYIELDED_STEP_S if self.more_threads_soon else None

    @property
    def in_a_yield(self) -> bool:
        """This step runs on threads a busy lender yielded."""
        return any(lending.running_yield for lending in self._lendings)

    def _wait_for_a_yield(self, now: float) -> None:
        if not self._lendings:
            return
        deadline = now + YIELD_WAIT_S
        while now < deadline:
            to_come = [lending.yield_to_come(now) for lending in self._lendings]
            if None in to_come or OPEN_NOW not in to_come:
                return  # a lender lends or never yields soon, or none yields at its next step
            time.sleep(POLL_S)
            now = time.monotonic()

    def step_done(self) -> None:
        """Engine thread, after a step (or when idle): end the yields it ran in."""
        for lending in self._lendings:
            lending.step_done()

    def idle(self) -> None:
        """Engine thread, when it has no work: end its yields and ask for none."""
        self.step_done()
        self.more_threads_soon = False
        now = time.monotonic()
        for lending in self._lendings:
            lending.set_wants(False, now)

    def hold(self) -> None:
        """A request was handed off: its decode worker is about to be busy."""
        until = time.monotonic() + HANDOFF_HOLD_S
        for lending in self._lendings:
            lending.held_until, lending.seen_busy = until, False

    def close(self) -> None:
        self.idle()
        for lending in self._lendings:
            if lending.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(lending.fd)
                lending.fd = None
