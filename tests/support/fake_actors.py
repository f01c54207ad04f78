"""Worker actors in process, called the way ``coordinator.cluster`` calls Ray actors
(``method.remote(...)``), each sending its requests' events on a real token channel (a
``TokenSender`` on loopback, no credentials), so the real ``Cluster``, ``Fleet.streams`` and
``Router`` run without Ray.

As a real worker does, ``generate`` and ``prefill`` only queue: they answer ``Submitted`` (or
``Submitted.unattached`` with the channel's endpoint when the request's owner did not say hello
there) and a task of the worker sends the events, one per step. ``reserve`` answers a
``Reservation`` (or ``Reservation.unattached``); a prefill's hand-off to it (its KV endpoint)
starts its decoding, and the prefill worker then sends the ``HandoffResult``.

A worker's model emits output token n as 100 + n, up to ``MAX_NEW`` tokens. Its ``behaviour``:
``None`` finishes; ``"stall"`` waits after the attempt's first token until it is aborted, then
ends with an ``abort`` event (as an engine does); ``"fail"`` ends with a ``worker_lost`` error
after the attempt's first token and keeps the request until it is aborted (as a broken worker
would); ``"refuse_constraint"`` refuses every request sent to it as a worker refuses a
constraint it cannot compile. ``held`` names the requests a worker still holds: empty once
everything was dropped. ``restart`` gives it another process (pid, token channel), as Ray's
restart of an actor does: its ``ready`` answers with the new pid, channel and kernels from the
cached build.

``install`` puts fakes into a real ``Fleet`` as ``Fleet.start`` would (each asked ``ready``
once: the fleet's identities name their channels); ``close_fleet`` closes the fleet's end and
every fake's channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from coordinator.pool.fleet import Fleet
from engine.kv_events import KvEventBatch
from engine.outputs import CONSTRAINT_VIOLATED, EngineStats, TokenEvent
from engine.request import FinishReason
from workers.contracts import (
    GenerationRequest,
    HandoffResult,
    HandoffTarget,
    Reservation,
    Submitted,
    WorkerIdentity,
    WorkerLoad,
    WorkerReport,
)
from workers.token_channel import TokenSender

MAX_NEW = 4
NO_EVENTS = KvEventBatch("", b"", 0)  # a worker that publishes no prefix-cache events
_KV_ENDPOINTS = itertools.count()
# KV endpoint -> the decode worker that reserved there (where a prefill's pages go)
_DECODERS: weakref.WeakValueDictionary[str, FakeWorker] = weakref.WeakValueDictionary()


def reports_of(loads: list[WorkerLoad]) -> list[WorkerReport]:
    """Load polls of workers that publish no prefix-cache events (``Cluster.reports``)."""
    return [WorkerReport(load, NO_EVENTS) for load in loads]


class _Method:
    """An actor method: ``remote`` calls it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


def token(request_id: str, n: int) -> TokenEvent:
    reason = FinishReason.LENGTH if n + 1 == MAX_NEW else None
    return TokenEvent(request_id, 100 + n, f"<{n}>", 3, n + 1, time.monotonic(), reason)


class FakeWorker:
    def __init__(self, role: str, instance: int, behaviour: str | None = None) -> None:
        self.role, self.instance, self.behaviour = role, instance, behaviour
        self.held: dict[str, asyncio.Event] = {}  # request id -> set when it is aborted
        self.pid = 1
        self.num_ready = 0  # ``ready`` calls answered
        self.sender = TokenSender()
        self._closed = False
        self.kv_endpoint = f"fake://{role}/{instance}/{next(_KV_ENDPOINTS)}"
        _DECODERS[self.kv_endpoint] = self
        self._requests: dict[str, GenerationRequest] = {}  # reserved here, decoded later
        self._tasks: set[asyncio.Task] = set()  # sending events
        self.ready = _Method(self._ready)
        self.load = _Method(self._load)
        self.report = _Method(self._report)
        self.reserve = _Method(self._reserve)
        self.abort = _Method(self._abort)
        self.prefill = _Method(self._prefill)
        self.generate = _Method(self._generate)

    def stop_answering(self) -> None:
        """Load polls time out from now on, as on a worker busy in a long step."""

        async def silent(*_args: Any) -> WorkerReport:
            raise TimeoutError

        self.report = _Method(silent)

    def restart(self) -> None:
        """Another process: a new pid and a new token channel (the old one closes)."""
        self.close()
        self.pid += 1
        self.sender, self._closed = TokenSender(), False

    def close(self) -> None:
        """Stop sending and close the token channel (idempotent)."""
        for task in self._tasks:
            if not task.done():
                with contextlib.suppress(RuntimeError):  # its loop is gone
                    task.cancel()
        self._tasks.clear()
        if not self._closed:
            self._closed = True
            self.sender.close()

    def identity(self) -> WorkerIdentity:
        """Its ``ready`` answer (counted as one)."""
        self.num_ready += 1
        kernels = {"attention_cpu": "built" if self.pid == 1 else "cached"}
        return WorkerIdentity(
            self.role,
            self.instance,
            self.pid,
            node_ip="10.0.0.1",
            kernels=kernels,
            token_channel=self.sender.endpoint,
        )

    async def _ready(self) -> WorkerIdentity:
        return self.identity()

    async def _load(self) -> WorkerLoad:
        idle = EngineStats(num_free_blocks=10, num_total_blocks=10)
        return WorkerLoad(self.role, self.instance, self.pid, idle)

    async def _report(self, owner: str, epoch: str, seq: int) -> WorkerReport:
        return WorkerReport(await self._load(), NO_EVENTS)

    def _attached(self, request: GenerationRequest) -> bool:
        return self.sender.is_attached(request.owner)

    async def _reserve(
        self, request: GenerationRequest, wait_s: float, max_output_tokens: int = 0
    ) -> Reservation:
        if not self._attached(request):
            return Reservation.unattached(self.sender.endpoint)
        self.held[request.request_id] = asyncio.Event()
        self._requests[request.request_id] = request
        return Reservation(True, self.kv_endpoint)

    async def _abort(self, request_id: str, owner: str = "") -> bool:
        self._requests.pop(request_id, None)
        aborted = self.held.pop(request_id, None)
        if aborted is not None:
            aborted.set()
        return aborted is not None

    async def _prefill(self, request: GenerationRequest, target: HandoffTarget) -> Submitted:
        if not self._attached(request):
            return Submitted.unattached(self.sender.endpoint)
        self._send(request.owner, self._prefilled(request, target))
        return Submitted(True)

    async def _generate(self, request: GenerationRequest, *_limit: int) -> Submitted:
        if not self._attached(request):
            return Submitted.unattached(self.sender.endpoint)
        if self.behaviour == "refuse_constraint":
            return Submitted(False, "the lark does not compile", cause=CONSTRAINT_VIOLATED)
        self.held[request.request_id] = asyncio.Event()
        self._send(request.owner, self._tokens(request, len(request.output_token_ids)))
        return Submitted(True)

    def _send(self, owner: str, items: AsyncIterator[TokenEvent | HandoffResult]) -> None:
        """Send ``items`` to ``owner`` on the token channel, one step each, in a task."""
        task = asyncio.ensure_future(self._sending(owner, items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sending(self, owner: str, items: AsyncIterator[TokenEvent | HandoffResult]) -> None:
        async for item in items:
            if isinstance(item, HandoffResult):
                self.sender.send_handoff(owner, item)
            else:
                self.sender.send_step({owner: [item]})
            await asyncio.sleep(0)

    async def _prefilled(
        self, request: GenerationRequest, target: HandoffTarget
    ) -> AsyncIterator[TokenEvent | HandoffResult]:
        """The first token; then, unless it was the last, the pages go to the decode worker of
        ``target`` (successfully while it holds the reservation), which starts decoding."""
        first = token(request.request_id, len(request.output_token_ids))
        yield first
        if not first.finished and target.hands_off:
            decoder = _DECODERS.get(target.endpoint)
            ok = decoder is not None and decoder._pages_arrived(request.request_id)
            error = None if ok else "no reservation for the pages"
            yield HandoffResult(request.request_id, ok, error, num_bytes=1, path="fake")

    def _pages_arrived(self, request_id: str) -> bool:
        """A reserved request's pages arrived: it decodes after its first token. False when it
        holds no such reservation (aborted)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._send(request.owner, self._tokens(request, len(request.output_token_ids) + 1))
        return True

    async def _tokens(self, request: GenerationRequest, start: int) -> AsyncIterator[TokenEvent]:
        """Tokens ``start`` on, as ``behaviour`` has it (module docstring)."""
        request_id = request.request_id
        aborted = self.held.get(request_id)
        if aborted is None:  # aborted before its first step
            return
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


def install(
    fleet: Fleet,
    prefills: list[FakeWorker] | None = None,
    decodes: list[FakeWorker] | None = None,
    colocated: list[FakeWorker] | None = None,
) -> Fleet:
    """``fleet`` with these fakes as its workers, each asked ``ready`` once as ``Fleet.start``
    does (its identity names its token channel, which ``Fleet.attach`` connects to)."""
    fleet.prefills, fleet.decodes = list(prefills or []), list(decodes or [])
    fleet.colocated = list(colocated or [])
    identities = [worker.identity() for worker in fleet.actors]
    fleet.ready_info = list(identities)
    fleet.identities = {(i.role, i.instance): i for i in identities}
    return fleet


def close_fleet(fleet: Fleet) -> None:
    """Close ``fleet``'s end of the token channels (its loop may be gone) and every fake's."""
    if fleet._streams is not None:
        fleet._streams.abandon()
        fleet._streams = None
    for worker in fleet.actors:
        if isinstance(worker, FakeWorker):
            worker.close()
