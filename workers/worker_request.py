"""The requests a worker holds, the single record of each outside the engine: the coordinator
that sent it (its events go to that coordinator's token channel) and, on a prefill worker, where
its KV goes.

A record lives from the request's arrival (``generate``, ``prefill``, or a decode worker's
``reserve``) until its final item goes out on the channel (a finished event, or a prefill's
hand-off result), or it is aborted, or its reservation is refused. So an idle worker holds no
request: ``len(requests)`` is 0.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from engine.outputs import TokenEvent
from workers.contracts import HandoffTarget


@dataclass
class WorkerRequest:
    request_id: str
    owner: str  # the coordinator that sent it (workers/leases.py), whose channel gets its events
    handoff: HandoffTarget | None = None  # prefill: where its KV goes once the engine holds it
    handing_off: bool = False  # prefill: its pages are on their way; the result ends it


class WorkerRequests:
    def __init__(self, role: str) -> None:
        self.role = role
        self._requests: dict[str, WorkerRequest] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._requests

    def open(self, request_id: str, owner: str, handoff: HandoffTarget | None = None) -> None:
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use on {self.role}")
            self._requests[request_id] = WorkerRequest(request_id, owner, handoff)

    def owner_of(self, request_id: str) -> str | None:
        """The coordinator of ``request_id``; None if it is not held here."""
        with self._lock:
            request = self._requests.get(request_id)
            return None if request is None else request.owner

    def owned_by(self, owner: str) -> list[str]:
        """The ids of ``owner``'s requests here."""
        with self._lock:
            return [r.request_id for r in self._requests.values() if r.owner == owner]

    def count_by_owner(self) -> dict[str, int]:
        """How many requests each coordinator holds here (a dead one's reach 0 once its lease
        lapsed and they were aborted)."""
        with self._lock:
            return dict(Counter(r.owner for r in self._requests.values()))

    def take_handoff(self, request_id: str) -> HandoffTarget | None:
        """The hand-off target of ``request_id``, once: the engine holds its KV now (from
        then on the request ends with its hand-off's result, not its first token)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.handoff is None:
                return None
            target, request.handoff, request.handing_off = request.handoff, None, True
            return target

    def route(self, events: list[TokenEvent]) -> list[str | None]:
        """The owner each event goes to (None: its request is not held here), under one lock; a
        finished event ends its record, unless its hand-off's result is still to come."""
        owners: list[str | None] = []
        with self._lock:
            for event in events:
                request = self._requests.get(event.request_id)
                if request is not None and event.finished and not request.handing_off:
                    del self._requests[event.request_id]
                owners.append(None if request is None else request.owner)
        return owners

    def close(self, request_id: str) -> str | None:
        """Forget ``request_id`` (aborted, refused, or its hand-off's result went); its owner."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            return None if request is None else request.owner
