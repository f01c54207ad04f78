"""Worker actors in process, called the way ``coordinator.cluster`` calls Ray actors
(``method.remote(...)``, ``method.options(num_returns="streaming").remote(...)``), so the real
``Cluster`` and ``Router`` run without Ray.

A worker's model emits output token n as 100 + n, up to ``MAX_NEW`` tokens. Its ``behaviour``:
``None`` finishes; ``"stall"`` waits after the attempt's first token until it is aborted, then
ends with an ``abort`` event (as an engine does); ``"fail"`` ends with a ``worker_lost`` error
after the attempt's first token and keeps the request until it is aborted (as a broken worker
would). ``held`` names the requests a worker still holds: empty once everything was dropped.
``restart`` gives it another process (pid), as Ray's restart of an actor does: its ``ready``
answers with the new pid and kernels from the cached build.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.kv_events import KvEventBatch
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason
from workers.contracts import (
    GenerationRequest,
    HandoffResult,
    HandoffTarget,
    Reservation,
    WorkerIdentity,
    WorkerLoad,
    WorkerReport,
)

MAX_NEW = 4
NO_EVENTS = KvEventBatch("", b"", 0)  # a worker that publishes no prefix-cache events


def reports_of(loads: list[WorkerLoad]) -> list[WorkerReport]:
    """Load polls of workers that publish no prefix-cache events (``Cluster.reports``)."""
    return [WorkerReport(load, NO_EVENTS) for load in loads]


class _Method:
    """An actor method: ``remote`` calls it; ``options`` changes nothing."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


async def _value(item: Any) -> Any:
    return item


async def _refs(items: AsyncIterator[Any]) -> AsyncIterator[Awaitable[Any]]:
    """A streaming call's items, each behind an awaitable (Ray's object refs)."""
    async for item in items:
        yield _value(item)


def token(request_id: str, n: int) -> TokenEvent:
    reason = FinishReason.LENGTH if n + 1 == MAX_NEW else None
    return TokenEvent(request_id, 100 + n, f"<{n}>", 3, n + 1, time.monotonic(), reason)


class FakeWorker:
    def __init__(self, role: str, instance: int, behaviour: str | None = None) -> None:
        self.role, self.instance, self.behaviour = role, instance, behaviour
        self.held: dict[str, asyncio.Event] = {}  # request id -> set when it is aborted
        self.pid = 1
        self.num_ready = 0  # ``ready`` calls answered
        self.ready = _Method(self._ready)
        self._requests: dict[str, GenerationRequest] = {}  # reserved here, streamed later
        self.load = _Method(self._load)
        self.report = _Method(self._report)
        self.reserve = _Method(self._reserve)
        self.abort = _Method(self._abort)
        self.prefill = _Method(lambda r, target: _refs(self._prefill(r, target)))
        self.stream = _Method(lambda request_id: _refs(self._stream(request_id)))
        self.generate = _Method(lambda r, *_limit: _refs(self._generate(r)))

    def restart(self) -> None:
        self.pid += 1

    async def _ready(self) -> WorkerIdentity:
        self.num_ready += 1
        kernels = {"attention_cpu": "built" if self.pid == 1 else "cached"}
        return WorkerIdentity(
            self.role, self.instance, self.pid, node_ip="10.0.0.1", kernels=kernels
        )

    async def _load(self) -> WorkerLoad:
        idle = EngineStats(num_free_blocks=10, num_total_blocks=10)
        return WorkerLoad(self.role, self.instance, self.pid, idle)

    async def _report(self, owner: str, epoch: str, seq: int) -> WorkerReport:
        return WorkerReport(await self._load(), NO_EVENTS)

    async def _reserve(
        self, request: GenerationRequest, wait_s: float, max_output_tokens: int = 0
    ) -> Reservation:
        self.held[request.request_id] = asyncio.Event()
        self._requests[request.request_id] = request
        return Reservation(True, f"fake://{self.role}/{self.instance}")

    async def _abort(self, request_id: str) -> bool:
        self._requests.pop(request_id, None)
        aborted = self.held.pop(request_id, None)
        if aborted is not None:
            aborted.set()
        return aborted is not None

    async def _prefill(
        self, request: GenerationRequest, target: HandoffTarget
    ) -> AsyncIterator[Any]:
        """The first token; then, unless it was the last, the pages go (always successfully)."""
        first = token(request.request_id, len(request.output_token_ids))
        yield first
        if not first.finished:
            yield HandoffResult(request.request_id, True, num_bytes=1, path="fake")

    async def _stream(self, request_id: str) -> AsyncIterator[TokenEvent]:
        request = self._requests.pop(request_id)
        async for event in self._tokens(request, len(request.output_token_ids) + 1):
            yield event

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.held[request.request_id] = asyncio.Event()
        async for event in self._tokens(request, len(request.output_token_ids)):
            yield event

    async def _tokens(self, request: GenerationRequest, start: int) -> AsyncIterator[TokenEvent]:
        """Tokens ``start`` on, as ``behaviour`` has it (module docstring)."""
        request_id = request.request_id
        aborted = self.held[request_id]
        for n in range(start, MAX_NEW):
            if n > len(request.output_token_ids) and self.behaviour == "stall":
                await aborted.wait()
                yield TokenEvent(request_id, None, "", 3, n, time.monotonic(), FinishReason.ABORT)
                return
            if n > len(request.output_token_ids) and self.behaviour == "fail":
                yield TokenEvent.failure(request_id, "worker died", "worker_lost")
                return
            if n + 1 == MAX_NEW:
                self.held.pop(request_id, None)  # finished: dropped before its last event goes
            yield token(request_id, n)
            await asyncio.sleep(0)
