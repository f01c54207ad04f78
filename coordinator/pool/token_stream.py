"""One request's items from one worker, on the coordinator: between a token channel's
receiving callback (which pushes, never waiting) and the request's reader (which iterates).

Life cycle: ``TokenStreams.open`` makes it; the receiving callback ``push``es the request's items
in order; it is ``ended`` once it holds its final item (a finished event, a prefill's
:class:`HandoffResult`, or a failure that ``end`` put); the reader's iteration stops after
taking that item, and the stream tells its owner (``on_done``) that it is done. ``stop`` (the
owner's ``close``) ends the iteration after what it holds, without a final item. A push past
``max_queued`` unread events overflows it: what it holds is dropped and it ends with a
``stream_overflow`` failure.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from engine.outputs import TokenEvent
from workers.contracts import HandoffResult

StreamItem = TokenEvent | HandoffResult
SLOW_CLIENT = "stream_overflow"  # the cause of the failure that ends an overflowed stream
WorkerKey = tuple[str, int]  # (role, instance), as the fleet names a worker


class TokenStream:
    def __init__(
        self,
        request_id: str,
        worker: WorkerKey,
        max_queued: int,
        on_done: Callable[[TokenStream], None],
    ) -> None:
        self.request_id = request_id
        self.worker = worker  # where its items come from: that worker's loss ends it
        self.max_queued = max_queued
        self.overflowed = False
        self.ended = False  # its final event is queued (or was read)
        self._stopped = False
        self._events: deque[StreamItem] = deque()
        self._ready = asyncio.Event()
        self._on_done = on_done

    def push(self, event: StreamItem) -> bool:
        """Queue ``event``; False if that overflowed the stream (it ended with a failure)."""
        if len(self._events) >= self.max_queued:
            self.overflowed = True
            self._events.clear()
            error = f"more than {self.max_queued} token events unread"
            self.end(TokenEvent.failure(self.request_id, error, SLOW_CLIENT))
            return False
        self._events.append(event)
        self.ended = is_final(event)
        self._ready.set()
        return True

    def end(self, event: TokenEvent) -> None:
        """Queue the final ``event`` (past the bound: it is the last one), unless the stream
        has its final item already (then ``event`` is dropped: a stream ends once)."""
        if self.ended:
            return
        self._events.append(event)
        self.ended = True
        self._ready.set()

    def stop(self) -> None:
        """End the iteration after what is queued, without a final event."""
        self._stopped = True
        self._ready.set()

    def __len__(self) -> int:
        return len(self._events)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> StreamItem:
        while not self._events:
            if self._stopped:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        event = self._events.popleft()
        if is_final(event):
            self._stopped = True
            self._on_done(self)
        return event


def is_final(item: StreamItem) -> bool:
    """A finished event or a hand-off's result: nothing follows it from that worker."""
    return isinstance(item, HandoffResult) or item.finished
