"""Hand-offs waiting for KV blocks on a full decode worker, granted strictly by (priority, arrival).

Engine thread only: the decode worker reaches it through ``EngineLoop.call`` and from its event
callback, so it needs no lock. ``grant`` runs when a hand-off arrives and whenever blocks may have
been freed: it reserves blocks for waiters in order and stops at the first that does not fit, so
a priority-1 hand-off is never overtaken by a later or lower-priority one. Each waiter's answer
(a future) is None once granted, else the reason it was refused.
"""

from __future__ import annotations

import heapq
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.errors import RequestRejectedError
from engine.llm_engine import LLMEngine
from engine.worker.contracts import GenerationRequest


@dataclass(order=True)
class Waiter:
    priority: int
    seq: int
    request: GenerationRequest = field(compare=False)
    answer: Future[str | None] = field(default_factory=Future, compare=False)


class ReservationQueue:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # a granted reservation's time for its pages to arrive
        self._heap: list[Waiter] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, engine: LLMEngine, request: GenerationRequest) -> Future[str | None]:
        """Queue a hand-off and serve the queue; the future answers it."""
        waiter = Waiter(request.priority, next(self._seq), request)
        heapq.heappush(self._heap, waiter)
        self.grant(engine)
        return waiter.answer

    def grant(self, engine: LLMEngine) -> None:
        """Reserve blocks for waiters in order while they fit."""
        while self._heap:
            request = self._heap[0].request
            try:
                reserved = engine.reserve_import(
                    request.request_id,
                    request.prompt_token_ids,
                    request.params,
                    request.priority,
                    self.timeout_s,
                )
                if reserved is None:
                    return
                refusal = None
            except RequestRejectedError as exc:  # e.g. the request id is already in use
                refusal = str(exc)
            heapq.heappop(self._heap).answer.set_result(refusal)

    def withdraw(self, engine: LLMEngine, request_id: str) -> None:
        """A waiter waited long enough: refuse it, saying why (unless answered meanwhile)."""
        waiter = self._remove(request_id)
        if waiter is not None:
            waiter.answer.set_result(engine.reservation_refusal(waiter.request.num_prompt_tokens))

    def cancel(self, request_id: str) -> bool:
        """Abort a waiting hand-off: refused at once."""
        waiter = self._remove(request_id)
        if waiter is not None:
            waiter.answer.set_result("aborted while waiting for KV blocks")
        return waiter is not None

    def _remove(self, request_id: str) -> Waiter | None:
        for waiter in self._heap:
            if waiter.request.request_id == request_id:
                self._heap.remove(waiter)
                heapq.heapify(self._heap)
                return waiter
        return None
