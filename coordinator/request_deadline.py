"""A request's deadline over its waits for events: one timer per limit, not one per event.

A stream waits for its next event, hands it to its client, waits again. Only the waits are
timed: a deadline that passes while the client's write is under way must not cancel that write.
``asyncio.timeout`` around each wait does that with a timer made and cancelled per event; a
:class:`Deadline` keeps one timer per limit (the first token's, then the whole answer's), and
when it fires it cancels the stream's task only if the task is inside a wait; if not, the next
wait ends at once. Either way the wait raises :class:`RequestTimeout` with the limit's message.
Cancellation from elsewhere (a client gone, the server stopping) is told apart as
``asyncio.timeout`` tells it apart: by the task's count of cancellation requests.

    deadline = Deadline(run.created_at)
    deadline.set(60.0, "Request first token timeout")
    try:
        event = await deadline.wait(events)    # events.__anext__(), within the deadline
    finally:
        deadline.clear()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from coordinator.errors import RequestTimeout

T = TypeVar("T")
MIN_WAIT_S = 0.001  # a limit set when it has passed already: its timer fires this soon


class Deadline:
    def __init__(self, created_at: float) -> None:
        """``created_at``: when the request was made (``time.monotonic``), which the limits
        count from."""
        self.created_at = created_at
        self.message = ""
        self.expired = False
        self._limit = float("inf")
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task | None = None  # the task inside a wait, if any
        self._cancelled = False  # the timer cancelled the waiting task

    def set(self, limit_s: float, message: str) -> None:
        """Time the waits to ``limit_s`` from the request's creation (inf: untimed), timing out
        with ``message``; the same limit again keeps its timer."""
        if limit_s == self._limit:
            self.message = message
            return
        self.clear()
        self._limit, self.message, self.expired = limit_s, message, False
        if limit_s != float("inf"):
            loop = asyncio.get_running_loop()
            left = max(self.created_at + limit_s - time.monotonic(), MIN_WAIT_S)
            self._timer = loop.call_at(loop.time() + left, self._expire)

    def clear(self) -> None:
        """No timer from now on."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def wait(self, events: AsyncIterator[T]) -> T:
        """``events``' next item, unless the deadline passes first (:class:`RequestTimeout`;
        StopAsyncIteration at their end)."""
        if self.expired:
            raise RequestTimeout(self.message)
        task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._waiting, self._cancelled = task, False
        try:
            return await events.__anext__()
        except asyncio.CancelledError:
            if self._cancelled and task.uncancel() <= cancelling:
                raise RequestTimeout(self.message) from None
            raise
        finally:
            self._waiting = None

    def _expire(self) -> None:
        self._timer, self.expired = None, True
        if self._waiting is not None and not self._cancelled:
            self._cancelled = True
            self._waiting.cancel()
