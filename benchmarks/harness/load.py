"""The one load generator: an open loop (requests sent at their arrival times, Poisson or fixed
intervals, with an optional cap on those in flight) and a closed loop (N streams, each sending
its next request when the last one ended, in a thread until stopped). Whatever ``send_one``
raises is kept as that request's error: no request is ever dropped from the records."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from benchmarks.harness.client import Target, send
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.workload import WorkItem

ABANDONED = "abandoned in flight when the closed loop stopped"
LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256)


def arrival_times(
    count: int | None,
    request_rate: float | None,
    poisson: bool = True,
    seed: int = 0,
    seconds: float | None = None,
) -> list[float]:
    """When each request goes, from the start: ``count`` of them, or as many as arrive within
    ``seconds``; a rate of None sends them all at once."""
    rng = random.Random(seed)
    times: list[float] = []
    at = 0.0
    while (count is None or len(times) < count) and (seconds is None or at < seconds):
        times.append(at)
        if not request_rate:
            if count is None:
                raise ValueError("requests at once need a count")
            continue
        at += rng.expovariate(request_rate) if poisson else 1 / request_rate
    return times


async def run_load(
    items: list[WorkItem],
    send_one: Callable[[WorkItem], Awaitable[RequestRecord]],
    request_rate: float | None = None,
    concurrency: int | None = None,
    poisson: bool = True,
    seed: int = 0,
    on_done: Callable[[], None] | None = None,
    arrivals: list[float] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``items`` at their ``arrivals`` (else at ``request_rate``: Poisson or fixed
    intervals; None: all at once), never more than ``concurrency`` in flight; returns the
    records (in order) and the run time."""
    if arrivals is None:
        arrivals = arrival_times(len(items), request_rate, poisson, seed)
    limit = asyncio.Semaphore(concurrency or len(items) or 1)
    start = time.perf_counter()

    async def one(item: WorkItem, at: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            sent_at = time.perf_counter() - start
            try:
                record = await send_one(item)
            except Exception as exc:  # kept, with its error, and counted as failed
                record = RequestRecord(item.prompt_tokens, item.output_tokens)
                record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.sent_at = sent_at
        if on_done is not None:
            on_done()
        return record

    records = await asyncio.gather(*(one(i, a) for i, a in zip(items, arrivals, strict=True)))
    return list(records), time.perf_counter() - start


def round_robin(
    client: httpx.AsyncClient, targets: list[Target]
) -> Callable[[WorkItem], Awaitable[RequestRecord]]:
    """A ``send_one`` spreading requests over ``targets`` in turn, in the order they go."""
    turn = itertools.count()

    async def send_one(item: WorkItem) -> RequestRecord:
        return await send(client, targets[next(turn) % len(targets)], item)

    return send_one


@dataclass
class ClosedLoop:
    """``streams`` closed-loop requests against ``target`` in a thread until ``stop``: each
    stream sends ``make_item(stream, turn)`` when its last request ended; ``on_event(stream,
    event)`` sees every event of every stream as it arrives (in that thread). A record's
    ``sent_at`` counts from ``started`` (``time.perf_counter``; by default, the loop's start)."""

    target: Target
    streams: int
    make_item: Callable[[int, int], WorkItem]
    records: list[RequestRecord] = field(default_factory=list)
    on_event: Callable[[int, dict], None] | None = None
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: asyncio.Future | None = None
        self._in_flight: dict[int, RequestRecord] = {}
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:

            async def stream(index: int) -> None:
                turn = 0
                on_event = self.on_event
                seen = None if on_event is None else lambda event: on_event(index, event)
                while not self._stop.is_set():
                    sent_at = time.perf_counter() - self.started
                    item = self.make_item(index, turn)
                    record = RequestRecord(item.prompt_tokens, item.output_tokens, sent_at)
                    self._in_flight[index] = record
                    try:
                        await send(client, self.target, item, on_event=seen, record=record)
                    except asyncio.CancelledError:
                        record.error = ABANDONED
                        raise
                    finally:
                        del self._in_flight[index]
                        self.records.append(record)
                    turn += 1
                    if not record.ok:
                        await asyncio.sleep(0.05)  # a server that is gone: do not spin

            self._loop = asyncio.get_running_loop()
            self._running = asyncio.gather(*(stream(i) for i in range(self.streams)))
            with contextlib.suppress(asyncio.CancelledError):
                await self._running

    def first_tokens_since(self, since: float) -> int:
        """How many requests sent from ``since`` on have had their first token, in flight or
        ended (safe from another thread: it only reads)."""
        seen = [*self.records, *list(self._in_flight.values())]
        return sum(r.sent_at >= since and r.ttft_s is not None for r in seen)

    def stop(self, timeout_s: float = 120, cancel: bool = False) -> list[RequestRecord]:
        """Every request's record; ``cancel``: the requests in flight are abandoned (their
        connections closed, their records with what arrived and the error ``ABANDONED``) instead
        of awaited."""
        self._stop.set()
        if cancel and self._loop is not None and self._running is not None:
            self._loop.call_soon_threadsafe(self._running.cancel)
        self._thread.join(timeout_s)
        return self.records
