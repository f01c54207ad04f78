"""One request on a worker, the single record of it outside the engine: its event queue, whether
a stream reads it, when it ended unread, and (prefill) where its KV goes.

Life of a :class:`WorkerRequest` (``WorkerRequests`` holds every live one, under one lock):

    ===============  ===========================================  ===============
    phase            event                                        next
    ===============  ===========================================  ===============
    (none)           ``open`` (generate, prefill, reserve)        OPEN, STREAMING
    OPEN             ``claim`` (a decode worker's ``stream``)     STREAMING
    OPEN             final item put (finished event, hand-off)    ENDED_UNREAD
    ENDED_UNREAD     ``claim``                                    STREAMING
    STREAMING        the stream reads the final item, or stops    gone
    OPEN, ENDED_…    ``close`` (abort, refused reservation)       gone
    ENDED_UNREAD     ``drop_unclaimed`` after its grace           gone
    ===============  ===========================================  ===============

A decode request may legitimately finish before its ``stream`` call (it ended on its first
decode step), but a coordinator that is gone never calls, so an unread one does not outlive
its grace. So an idle worker holds no request: ``len(requests)`` is 0.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from workers.contracts import HandoffResult, HandoffTarget

log = logging.getLogger(__name__)


class Phase(enum.IntEnum):
    OPEN = 0
    STREAMING = 1
    ENDED_UNREAD = 2


@dataclass
class WorkerRequest:
    request_id: str
    phase: Phase = Phase.OPEN
    events: queue.Queue = field(default_factory=queue.Queue, repr=False)
    ended_at: float | None = None  # ENDED_UNREAD: when its final item came
    handoff: HandoffTarget | None = None  # prefill: where its KV goes once the engine holds it
    owner: str = ""  # the coordinator that sent it (workers/leases.py)


class WorkerRequests:
    def __init__(self, role: str) -> None:
        self.role = role
        self._requests: dict[str, WorkerRequest] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def open(
        self,
        request_id: str,
        streaming: bool = False,
        handoff: HandoffTarget | None = None,
        owner: str = "",
    ) -> WorkerRequest:
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use on {self.role}")
            phase = Phase.STREAMING if streaming else Phase.OPEN
            request = WorkerRequest(request_id, phase, handoff=handoff, owner=owner)
            self._requests[request_id] = request
            return request

    def owned_by(self, owner: str) -> list[str]:
        """The ids of ``owner``'s requests here."""
        with self._lock:
            return [r.request_id for r in self._requests.values() if r.owner == owner]

    def count_by_owner(self) -> dict[str, int]:
        """How many requests each coordinator holds here (a dead one's reach 0 once its lease
        lapsed and they were aborted)."""
        with self._lock:
            return dict(Counter(r.owner for r in self._requests.values()))

    def claim(self, request_id: str) -> WorkerRequest | None:
        """``request_id`` for one stream to read; None if unknown, or a stream reads it."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.phase == Phase.STREAMING:
                return None
            request.phase, request.ended_at = Phase.STREAMING, None
            return request

    def put(self, request_id: str, item: Any) -> None:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            if is_final(item) and request.phase == Phase.OPEN:
                request.phase, request.ended_at = Phase.ENDED_UNREAD, time.monotonic()
            request.events.put(item)

    def take_handoff(self, request_id: str) -> HandoffTarget | None:
        """The hand-off target of ``request_id``, once: the engine holds its KV now."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return None
            target, request.handoff = request.handoff, None
            return target

    def close(self, request_id: str) -> None:
        """Forget ``request_id``, unless a stream reads it (that stream forgets it itself)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is not None and request.phase != Phase.STREAMING:
                del self._requests[request_id]

    def drop_unclaimed(self, grace_s: float) -> None:
        """Forget requests ended and unread for ``grace_s``."""
        horizon = time.monotonic() - grace_s
        with self._lock:
            for request in list(self._requests.values()):
                if request.ended_at is not None and request.ended_at <= horizon:
                    del self._requests[request.request_id]
                    log.info("dropped the events of %s: nobody streamed them", request.request_id)

    def drain(self, request: WorkerRequest) -> Iterator[Any]:
        """Items of ``request`` (opened streaming, or claimed) up to the final one."""
        try:
            while True:
                item = request.events.get()
                yield item
                if is_final(item):
                    return
        finally:
            with self._lock:
                self._requests.pop(request.request_id, None)


def is_final(item: Any) -> bool:
    """A finished event or a hand-off's result: nothing follows it."""
    return isinstance(item, HandoffResult) or bool(item.finished)
