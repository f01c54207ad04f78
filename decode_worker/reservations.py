"""Hand-offs waiting for KV blocks on a full decode worker, granted strictly by (priority, arrival).

Engine thread only: the decode worker reaches it through ``EngineLoop.call`` and from its event
callback, so it needs no lock. ``grant`` runs when a hand-off arrives and whenever blocks may have
been freed: it reserves blocks for waiters in order and stops at the first that does not fit, so
a priority-1 hand-off is never overtaken by a later or lower-priority one.

A waiter that, at the pace blocks were granted lately (``wait_estimate.py``), would have its
blocks only later than ``LATE_MARGIN`` times the time it may still wait is refused at once, for
want of room, with that estimate (the coordinator's ``Retry-After``): a burst the pool cannot
serve in time is told so in milliseconds, not at its timeout. Whenever blocks are granted or a
hand-off arrives, the queue is checked again in order.

Each waiter's answer is a future its ``reserve`` call waits on: once granted, the number of leading
blocks it shares from the prefix cache (an int, pages not to send), else the reason it was refused
(a str; a :class:`NoRoom` when it waited as long as it could for blocks). The caller may give up
first (``answer.cancel()``, when the engine thread did not answer in time); the future's own
protocol (``set_running_or_notify_cancel``) decides who was first, and a waiter given up on is
dropped, its blocks freed if they were just reserved.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from decode_worker.wait_estimate import GrantPace, seconds_for
from engine.errors import RequestRejectedError
from engine.request import NewRequest

if TYPE_CHECKING:  # the engine's types: a coordinator imports this module without torch
    from engine.llm_engine import LLMEngine

LATE_MARGIN = 1.25  # an estimate is trusted only this far past the time a waiter may wait


class NoRoom(str):
    """A refusal for want of room (the pool is full now), not for anything the request is;
    ``retry_after_s``: when a retry may find room (0: no estimate)."""

    retry_after_s: float = 0.0

    @classmethod
    def expected(cls, reason: str, retry_after_s: float) -> NoRoom:
        refusal = cls(reason)
        refusal.retry_after_s = retry_after_s
        return refusal


class Moved(str):
    """A refusal because the worker is leaving the decode role: the request goes elsewhere."""


@dataclass(order=True)
class Waiter:
    priority: int
    seq: int
    request: NewRequest = field(compare=False)  # with its output limit
    token: str = field(compare=False, repr=False)  # the reservation's secret
    need: int = field(compare=False)  # new blocks it takes, as the prefix cache was at its arrival
    deadline: float = field(compare=False)  # when its caller stops waiting (time.monotonic())
    answer: Future[int | str] = field(default_factory=Future, compare=False)


class ReservationQueue:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s  # a granted reservation's time for its pages to arrive
        self.clock = clock  # the pace's and the waiters' deadlines' (time.monotonic())
        self._heap: list[Waiter] = []
        self._seq = itertools.count()
        self.pace = GrantPace()
        self.num_refused_early = 0  # waiters refused on the pace's estimate (a counter)
        # seconds until every waiter's blocks are expected, as of the last grant (0: no
        # estimate); other threads read it as a hint (a refusal's Retry-After)
        self.drain_s = 0.0

    def __len__(self) -> int:
        return len(self._heap)

    def add(
        self,
        engine: LLMEngine,
        request: NewRequest,
        token: str,
        answer: Future,
        deadline: float = float("inf"),
    ) -> None:
        """Queue a hand-off whose pages must carry ``token``, answered through ``answer``, whose
        caller waits until ``deadline`` (``time.monotonic()``), and serve the queue."""
        if answer.cancelled():  # its caller gave up before we got here
            return
        need = engine.importer.blocks_needed(request)
        waiter = Waiter(request.priority, next(self._seq), request, token, need, deadline, answer)
        heapq.heappush(self._heap, waiter)
        self.grant(engine)

    def grant(self, engine: LLMEngine) -> None:
        """Reserve blocks for waiters in order while they fit; then refuse those the pace says
        will not be served in time."""
        self._grant(engine)
        now = self.clock()
        self.pace.waiting(now, bool(self._heap))
        pace = self.pace.blocks_per_s(now)
        self.drain_s = self._refuse_late(engine, now, pace) if pace else 0.0
        self.pace.waiting(now, bool(self._heap))

    def _grant(self, engine: LLMEngine) -> None:
        while self._heap:
            waiter = self._heap[0]
            if waiter.answer.cancelled():
                heapq.heappop(self._heap)
                continue
            request = waiter.request
            try:
                # its pages' deadline and its queueing here count from the grant
                granted = replace(request, arrival_time=time.monotonic())
                reserved = engine.importer.reserve_import(granted, self.timeout_s, waiter.token)
                if reserved is None:
                    return
                result: int | str = reserved.num_shared_blocks
                taken = len(reserved.block_ids) - reserved.num_shared_blocks
                self.pace.granted(self.clock(), taken)
            except RequestRejectedError as exc:  # e.g. the request id is already in use
                result = str(exc)
            heapq.heappop(self._heap)
            if not _answer(waiter, result) and isinstance(result, int):
                engine.abort(request.request_id)  # given up on just now: free its blocks

    def _refuse_late(self, engine: LLMEngine, now: float, pace: float) -> float:
        """Refuse, in order, every waiter whose blocks, at ``pace`` blocks a second, are expected
        later than ``LATE_MARGIN`` times the time it may still wait (those behind it move up);
        the seconds in which the blocks of the waiters left are expected."""
        free, ahead, late = engine.blocks.num_free_blocks, 0, []
        for waiter in sorted(self._heap):
            wait_s = seconds_for(ahead + waiter.need - free, pace)
            left_s = waiter.deadline - now
            if wait_s > left_s * LATE_MARGIN:
                late.append((waiter, wait_s, left_s))
            else:
                ahead += waiter.need
        for waiter, wait_s, left_s in late:
            self._heap.remove(waiter)
            reason = (
                f"decode cache full: blocks for this hand-off expected in {wait_s:.0f} s, later "
                f"than the {max(left_s, 0):.0f} s it may wait"
            )
            self.num_refused_early += _answer(waiter, NoRoom.expected(reason, wait_s))
        if late:
            heapq.heapify(self._heap)
        return seconds_for(ahead - free, pace)

    def withdraw(self, engine: LLMEngine, request_id: str) -> None:
        """A waiter waited long enough: refuse it, saying why (unless answered meanwhile)."""
        waiter = self._remove(request_id)
        if waiter is not None:
            refusal = engine.importer.reservation_refusal(len(waiter.request.token_ids))
            _answer(waiter, NoRoom(refusal))

    def refuse_all(self, refusal: str) -> None:
        """Refuse every waiting hand-off with ``refusal``."""
        waiters, self._heap = self._heap, []
        self.pace.waiting(self.clock(), False)
        for waiter in waiters:
            _answer(waiter, refusal)

    def cancel(self, request_id: str) -> bool:
        """Abort a waiting hand-off: refused at once."""
        waiter = self._remove(request_id)
        if waiter is not None:
            _answer(waiter, "aborted while waiting for KV blocks")
        return waiter is not None

    def _remove(self, request_id: str) -> Waiter | None:
        for waiter in self._heap:
            if waiter.request.request_id == request_id:
                self._heap.remove(waiter)
                heapq.heapify(self._heap)
                self.pace.waiting(self.clock(), bool(self._heap))
                return waiter
        return None


def _answer(waiter: Waiter, result: int | str) -> bool:
    """Answer ``waiter``; False if its caller gave up on it already."""
    if not waiter.answer.set_running_or_notify_cancel():
        return False
    waiter.answer.set_result(result)
    return True
