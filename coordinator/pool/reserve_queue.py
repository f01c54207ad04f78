"""Reserve calls to one decode worker beyond the places it lets wait, queued here instead of
refused.

A decode worker lets at most ``MAX_WAITING_RESERVATIONS`` reserve calls wait for KV blocks at
once (each holds one of its actor's threads) and refuses one more at once. A burst larger than
that is not a pool that cannot serve it in time: at the pace the worker grants blocks, many of
the refused could have been served well within their timeout. So each coordinator keeps, per
decode worker, a :class:`ReserveQueue`: at most ``places`` of its reserve calls are out at the
worker, the rest wait here, in the worker's own order (priority, then arrival), each holding a
future and no thread, and take a place as one frees. Where several coordinators hold a lease on
the worker, each keeps out only its share of the places (:func:`share_of_places`, resized at each
load poll from the count the worker reports), so together they do not overrun it.

A waiter the queue does not expect to see its first token within the time it may still wait is
refused at once, with the estimate (the client's ``Retry-After``): the grants it waits for are
those of every call out at the worker and of every waiter ahead of it here, at the pace grants
came lately while waiters waited here (``decode_worker/wait_estimate.py``'s :class:`GrantPace`,
one "block" a grant), and after its grant the time a granted request took lately to its first
token (the median of the last ``SETTLED_KEPT``, told by ``settled``). Before the pace is known
nobody is refused early; a waiter still here when its time is up is refused then, with the
estimate if there is one.

An arriving waiter is judged on an estimate ``ADMIT_MARGIN`` times the plain one; one already
waiting, on the plain estimate. So a waiter let in is refused later only where the pace fell by
more than the margin since, not whenever it wobbles: a client that waited is rarely turned away
after all, and one that will not fit is told at once.

    queue = ReserveQueue(places=48)
    async with queue.place(priority, deadline):     # raises Late
        reservation = await worker.reserve.remote(...)
        queue.answered(reservation.granted)
    ...
    queue.settled(first_token_at - granted_at)
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from decode_worker.wait_estimate import GrantPace, seconds_for

SETTLED_KEPT = 32  # grant-to-first-token times the estimate takes its median of
NO_ESTIMATE_RETRY_S = 1.0  # a refusal's Retry-After when no pace is known yet
ADMIT_MARGIN = 1.25  # an arriving waiter's estimate, times this, must fit its time


def share_of_places(places: int, num_coordinators: int) -> int:
    """One coordinator's share of a decode worker's ``places`` when ``num_coordinators`` hold a
    lease on it (at least one place each: with more coordinators than places, the worker refuses
    the excess at once, as it would without the share)."""
    return max(1, places // max(num_coordinators, 1))


class Late(Exception):
    """Refused for want of room: not expected to be granted within its time."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    deadline: float = field(compare=False)  # when its caller stops waiting (the queue's clock)
    given: asyncio.Future[None] = field(compare=False)  # done: a place, or a Late


class ReserveQueue:
    def __init__(self, places: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.places = places
        self.clock = clock
        self.out = 0  # reserve calls out at the worker
        self.pace = GrantPace()
        self.num_refused_early = 0  # refused on the estimate before their time was up
        self._settled: deque[float] = deque(maxlen=SETTLED_KEPT)
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Waiters queued here."""
        return len(self._heap)

    @contextlib.asynccontextmanager
    async def place(self, priority: int, deadline: float) -> AsyncIterator[None]:
        """One of the places out at the worker, held while the caller's call is out; waits here
        by (priority, arrival) until ``deadline`` (the queue's clock) for one; raises
        :class:`Late` when not expected in time, or when the time is up."""
        if self.out < self.places and not self._heap:
            self.out += 1
        else:
            await self._wait(priority, deadline)
        try:
            yield
        finally:
            self.out -= 1
            self._serve()

    def resize(self, places: int) -> None:
        """Keep at most ``places`` calls out from now on (those out beyond stay until they end);
        places added go to waiters at once."""
        self.places = max(1, places)
        self._serve()

    def answered(self, granted: bool) -> None:
        """A call out at the worker was answered: ``granted`` blocks or not (only grants made
        while waiters waited here count toward the pace)."""
        if granted:
            self.pace.granted(self.clock(), 1)

    def settled(self, seconds: float) -> None:
        """A granted request had its first token ``seconds`` after its grant."""
        self._settled.append(seconds)

    @property
    def after_grant_s(self) -> float:
        """The time a granted request takes to its first token, lately (0: none seen)."""
        return statistics.median(self._settled) if self._settled else 0.0

    async def _wait(self, priority: int, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._seq), deadline, loop.create_future())
        heapq.heappush(self._heap, waiter)
        self.pace.waiting(self.clock(), True)
        self._refuse_late(arriving=waiter)
        timer = loop.call_at(loop.time() + max(deadline - self.clock(), 0.0), self._expire, waiter)
        try:
            await waiter.given
        except asyncio.CancelledError:
            given = waiter.given
            if given.done() and not given.cancelled() and given.exception() is None:
                self.out -= 1  # given a place just as its caller went away: hand it on
            self._drop(waiter)
            self._serve()
            raise
        finally:
            timer.cancel()

    def _serve(self) -> None:
        """Hand free places to waiters in order; then refuse those expected too late."""
        while self._heap and self.out < self.places:
            waiter = heapq.heappop(self._heap)
            if not waiter.given.done():
                self.out += 1
                waiter.given.set_result(None)
        self.pace.waiting(self.clock(), bool(self._heap))
        self._refuse_late()

    def _refuse_late(self, arriving: _Waiter | None = None) -> None:
        """Refuse, in order, every waiter whose first token is expected later than the time
        it may still wait (those behind it move up); ``arriving``'s wait counted
        ``ADMIT_MARGIN`` times over."""
        now = self.clock()
        pace = self.pace.blocks_per_s(now)
        if not pace or not self._heap:
            return
        ahead, late, after_s = self.out, [], self.after_grant_s
        for waiter in sorted(self._heap):
            wait_s = seconds_for(ahead + 1, pace)
            left_s = waiter.deadline - now
            margin = ADMIT_MARGIN if waiter is arriving else 1.0
            if wait_s * margin + after_s > left_s:
                late.append((waiter, wait_s, left_s))
            else:
                ahead += 1
        for waiter, wait_s, left_s in late:
            reason = (
                f"decode cache full: blocks for this hand-off expected in {wait_s:.0f} s and its "
                f"first token {after_s:.0f} s later, past the {max(left_s, 0):.0f} s it may wait"
            )
            self._refuse(waiter, Late(reason, wait_s))
            self.num_refused_early += 1

    def _expire(self, waiter: _Waiter) -> None:
        """``waiter``'s time is up while it waits here."""
        now = self.clock()
        pace = self.pace.blocks_per_s(now)
        position = sorted(self._heap).index(waiter) if waiter in self._heap else 0
        retry_s = seconds_for(self.out + position + 1, pace) if pace else NO_ESTIMATE_RETRY_S
        reason = "decode cache full: no room for this hand-off within the time it may wait"
        self._refuse(waiter, Late(reason, retry_s))

    def _refuse(self, waiter: _Waiter, late: Late) -> None:
        self._drop(waiter)
        if not waiter.given.done():
            waiter.given.set_exception(late)
        self.pace.waiting(self.clock(), bool(self._heap))

    def _drop(self, waiter: _Waiter) -> None:
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
