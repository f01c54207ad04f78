"""Computes a step's grammar masks on threads of their own, each row within a CPU budget.

llguidance computes a mask without the GIL, so the constrained rows of a batch run in parallel
on :data:`MASK_THREADS` threads while the engine thread waits for them. A row whose computation
has used :data:`MASK_BUDGET_S` of its thread's CPU time without finishing is given up: its
request fails (``constraint_violated``) and the rest of the batch samples on time. CPU time, not
wall time: on a machine busy with other work (a worker restarting beside this one, a model
load, the interpreter's lock held by another thread) a row that waits is not the grammar's
fault, and failing its request for the machine's load would be wrong: the parser's limits
(``engine.grammars.LIMITS``) already bound a mask's work, so a waiting row is waited for, as the
forward itself is. Only a row held :data:`MASK_WALL_LIMIT_S` of wall time (a thread that is
stuck, not slow) is given up on wall time alone, so a step never waits longer than that. The
budget counts from the moment a row's computation starts on its thread, so a row
queued behind others is not charged for their time. A computation given up cannot be
interrupted; it finishes on its thread into a bitmask no one reads (the parser's limits,
``engine.grammars.LIMITS``, bound how long that takes), and its matcher is never touched again.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

MASK_THREADS = 4  # masks computed at once per engine
MASK_BUDGET_S = 0.020  # the most CPU time one row's mask may take
MASK_WALL_LIMIT_S = 2.0  # and the most wall time, whatever the CPU used


class Matcher(Protocol):
    def unsafe_compute_mask_ptr(self, trg_ptr: int, trg_bytes: int) -> None: ...


class MaskPool:
    """The threads one engine's masks are computed on (started at the first mask)."""

    def __init__(self, threads: int = MASK_THREADS) -> None:
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self, bitmask: torch.Tensor, matchers: Sequence[Matcher]) -> MaskJob:
        """Start filling ``bitmask[i]`` with the mask of ``matchers[i]``, each on a thread."""
        pool = self._started()
        rows = [_Row(matcher, bitmask, index) for index, matcher in enumerate(matchers)]
        return MaskJob(bitmask, [(pool.submit(row.compute), row) for row in rows])

    def compute(
        self, bitmask: torch.Tensor, matchers: Sequence[Matcher], budget_s: float | None = None
    ) -> list[str | None]:
        """:meth:`start` then :meth:`MaskJob.finish`."""
        return self.start(bitmask, matchers).finish(budget_s)

    def _started(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._threads, thread_name_prefix="grammar-mask"
                )
            return self._pool


class MaskJob:
    """The masks of one step, being computed into ``bitmask``."""

    def __init__(
        self, bitmask: torch.Tensor, rows: list[tuple[concurrent.futures.Future[None], _Row]]
    ) -> None:
        self.bitmask = bitmask
        self._rows = rows

    def finish(self, budget_s: float | None = None) -> list[str | None]:
        """Wait for the masks; per row, None when it was computed within ``budget_s`` (default
        :data:`MASK_BUDGET_S`) of its start, else why not (a row's words are then not to be
        read, nor its matcher used again)."""
        budget_s = MASK_BUDGET_S if budget_s is None else budget_s
        started = dict(self._rows)
        pending = set(started)
        while pending:
            now = time.monotonic()
            pending = {f for f in pending if not started[f].overdue(now, budget_s)}
            if pending:
                starts = [started[f].started_at or now for f in pending]
                # to the first budget's end, then every quarter budget (a row past its budget
                # of wall time but not of CPU is looked at again, not spun on)
                timeout = max(min(starts) + budget_s - now, budget_s / 4) + 1e-4
                pending = concurrent.futures.wait(
                    pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
                ).not_done
        return [_why_not(future, row) for future, row in self._rows]


class _Row:
    """One row's computation and when it started on its thread (None: still queued)."""

    def __init__(self, matcher: Matcher, bitmask: torch.Tensor, index: int) -> None:
        self.matcher, self.words = matcher, bitmask[index]
        self.started_at: float | None = None
        self.given_up = ""  # why it was given up, once it was

    def compute(self) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        self.cpu_started_at = time.clock_gettime(self.clock)
        self.started_at = time.monotonic()
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)

    def overdue(self, now: float, budget_s: float) -> bool:
        """Past its CPU budget, or past :data:`MASK_WALL_LIMIT_S` of wall time (its reason
        kept in ``given_up``)."""
        if self.started_at is None:
            return False
        if now - self.started_at >= MASK_WALL_LIMIT_S:
            self.given_up = f"its thread was held over {MASK_WALL_LIMIT_S:g} s"
            return True
        if now - self.started_at < budget_s:
            return False
        try:
            used = time.clock_gettime(self.clock) - self.cpu_started_at
        except OSError:  # its thread has ended: only the wall bound applies
            return False
        if used >= budget_s:
            self.given_up = f"took over {budget_s * 1000:.0f} ms of CPU"
        return used >= budget_s


def _why_not(future: concurrent.futures.Future[None], row: _Row) -> str | None:
    if not future.done():
        return f"computing the constraint's mask {row.given_up}"
    error = future.exception()
    return None if error is None else f"computing the constraint's mask failed: {error}"
