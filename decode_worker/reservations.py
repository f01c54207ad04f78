"""Incoming hand-offs waiting for KV blocks, granted strictly by (priority, arrival).

``grant`` runs on the engine thread (after every step that freed blocks, and when a waiter
arrives): it reserves blocks for waiters in order and stops at the first that does not fit, so a
priority-1 hand-off is never overtaken by a later or lower-priority one.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine


@dataclass(order=True)
class Waiter:
    priority: int
    seq: int
    request_id: str = field(compare=False)
    num_tokens: int = field(compare=False)
    done: threading.Event = field(default_factory=threading.Event, compare=False)
    error: str | None = field(default=None, compare=False)


class ReservationQueue:
    def __init__(self) -> None:
        self._heap: list[Waiter] = []
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request_id: str, num_tokens: int, priority: int) -> Waiter:
        waiter = Waiter(priority, next(self._seq), request_id, num_tokens)
        with self._lock:
            heapq.heappush(self._heap, waiter)
        return waiter

    def withdraw(self, waiter: Waiter) -> bool:
        """Take a waiter out; False if it was granted (or failed) meanwhile."""
        with self._lock:
            if waiter.done.is_set():
                return False
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
            return True

    def grant(self, engine: LLMEngine) -> None:
        """Engine thread: reserve blocks for waiters in order while they fit."""
        with self._lock:
            while self._heap:
                waiter = self._heap[0]
                try:
                    if engine.reserve_import(waiter.request_id, waiter.num_tokens) is None:
                        return
                except Exception as exc:  # e.g. the request id is already in use
                    waiter.error = str(exc)
                heapq.heappop(self._heap)
                waiter.done.set()

    def cancel(self, request_id: str) -> bool:
        """Abort a waiting hand-off: its ``reserve`` call returns at once with an error."""
        with self._lock:
            for waiter in self._heap:
                if waiter.request_id == request_id:
                    self._heap.remove(waiter)
                    heapq.heapify(self._heap)
                    waiter.error = "aborted while waiting for KV blocks"
                    waiter.done.set()
                    return True
        return False
