"""The scheduler's waiting queue: priority first (1 before 5), then round-robin across clients
within a priority, first come first served within a client.

Each request is given a round when it first joins: its client's next one, but never one already
served at its priority. Requests are taken in (priority, round, arrival) order, so a client that
queued a hundred requests gets one of them in each round while another client's single request
takes the next round's turn, instead of waiting behind all hundred. With a single client (or
none: ``client`` "") the rounds follow arrival, which is plain FCFS. A preempted request keeps
its round and so goes back ahead of later ones, as it would in FCFS.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from engine.request import Request

PRUNE_AT = 4096  # client lines remembered before the idle ones are dropped


class FairQueue:
    """Requests waiting for admission (the scheduler skips those that ended meanwhile)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], Request]] = []
        self._served: dict[int, int] = {}  # priority -> the latest round taken from it
        self._next: dict[tuple[int, str], int] = {}  # (priority, client) -> its next round
        self._queued: dict[tuple[int, str], int] = {}  # (priority, client) -> requests in the heap
        self._prune_at = PRUNE_AT

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in self._heap)

    def push(self, request: Request) -> None:
        priority, line = request.priority, (request.priority, request.client)
        self._queued[line] = self._queued.get(line, 0) + 1
        if request.queue_round is None:
            request.queue_round = max(self._next.get(line, 0), self._served.get(priority, 0))
            self._next[line] = request.queue_round + 1
            if len(self._next) >= self._prune_at:
                self._prune()
        key = (priority, request.queue_round, request.arrival_seq)
        heapq.heappush(self._heap, (key, request))

    def head(self) -> Request:
        """The request to admit next."""
        return self._heap[0][1]

    def pop(self) -> Request:
        (priority, queue_round, _), request = heapq.heappop(self._heap)
        self._served[priority] = max(self._served.get(priority, 0), queue_round)
        line = (priority, request.client)
        self._queued[line] -= 1
        if not self._queued[line]:
            del self._queued[line]
        return request

    def _prune(self) -> None:
        """Forget the clients with nothing queued whose next round is at most the one after the
        round served (a forgotten one may rejoin a round early: one turn, once)."""
        self._next = {
            line: next_round
            for line, next_round in self._next.items()
            if line in self._queued or next_round > self._served.get(line[0], 0) + 1
        }
        self._prune_at = max(PRUNE_AT, 2 * len(self._next))
