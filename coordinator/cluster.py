"""How one request runs on the fleet's workers (``coordinator/pool/fleet.py``): an attempt's flow.

``pd_separate``: a request goes to a (prefill, decode) pair chosen by the caller. The decode
worker first reserves blocks for the prompt (or refuses, saying why; reserve calls beyond the
places a decode worker lets wait queue here, ``pool/reserve_queue.py``); the prefill worker computes
the prompt and first token, streams that token, and pushes the KV pages to the decode worker's
endpoint; the decode worker's events follow. ``single_node``: one colocated worker does it all.

Failures end the stream with an ``error`` event (``FinishReason.ERROR``) whose ``cause`` names the
kind: ``reservation_refused`` (``pool_full`` when for want of room), ``handoff_failed``,
``worker_lost`` (the actor died; Ray restarts it and later requests use the new one),
``worker_restarting`` (a call reached an actor Ray is restarting) or ``engine_error``. Whatever ends
a stream early, ``abort`` reaches every worker that may still hold the request, in the background if
the caller is cancelled, and without waiting past ``RELEASE_WAIT_S`` for a worker that does not
answer (a stopped process gets the call when it resumes). Every request sent names this coordinator
(the fleet's ``coordinator_id``) as its owner.

A request's state is its :class:`~coordinator.request_run.RequestRun`, which the caller hands to
``stream``: the cluster sets its phase as the attempt goes (prefilling, handing off, decoding)
and the workers that may hold it (what ``abort`` and the release reach; empty once the stream
ended). It keeps no table of requests of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import ray

from coordinator.config.cluster import ClusterConfig
from coordinator.pool.fleet import Fleet
from coordinator.pool.prefix_pull import PullOutcome, pull_prefix
from coordinator.pool.reserve_queue import Late, ReserveQueue, share_of_places
from coordinator.pool.token_stream import StreamItem, TokenStream, WorkerKey
from coordinator.pool.token_streams import TokenChannelError, TokenStreams
from coordinator.request_run import RequestRun, RunPhase
from coordinator.routing.pull_cost import PullPlan
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.token_accounting import output_limit
from workers.contracts import (
    GenerationRequest,
    HandoffResult,
    HandoffTarget,
    Reservation,
    Submitted,
    WorkerReport,
)
from workers.runtime import MAX_WAITING_RESERVATIONS

log = logging.getLogger(__name__)
A = TypeVar("A", Submitted, Reservation)
_UNCLEAN = (FinishReason.ERROR, FinishReason.ABORT)
WORKER_RESTARTING = "worker_restarting"  # Ray is restarting the actor: no fault of the request
POOL_FULL = "pool_full"  # a decode worker had no room for the request for as long as it may wait
RELEASE_WAIT_S = 2.0  # how long a finished stream waits for its workers to drop the request


class Cluster:
    """Runs attempts on ``fleet`` (by default a new fleet of ``config``'s workers)."""

    def __init__(self, config: ClusterConfig, fleet: Fleet | None = None) -> None:
        self.config = config
        self.fleet = fleet or Fleet(config)
        # aborts still on their way to workers (a request's own state is its RequestRun's)
        self._releases: set[asyncio.Task] = set()
        # reserve calls beyond the places a decode worker lets wait, queued here (by its key)
        self._reserve_queues: dict[WorkerKey, ReserveQueue] = {}
        # (bytes, seconds, path) of each KV move that reached its decode worker
        self.on_handoff: Callable[[int, float, str], None] | None = None
        # (engine role, seconds queued, seconds computing) of each prompt, at its first token
        self.on_prefilled: Callable[[str, float, float], None] | None = None
        # each peer prefix pull made (kv_peer_pull), whether it installed blocks or not
        self.on_pull: Callable[[PullOutcome], None] | None = None

    async def generate(
        self, request: GenerationRequest, prefill: int | None = 0, decode: int = 0
    ) -> AsyncIterator[TokenEvent]:
        """Token events of one request of its own (no migration) on the pair ``(prefill,
        decode)``: ``stream`` of a fresh run routed there."""
        run = RequestRun(request)
        run.route_to((prefill, decode))
        async with contextlib.aclosing(self.stream(run)) as events:
            async for event in events:
                yield event

    async def stream(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        """Token events of ``run``'s attempt on ``run.route``; the last one is finished (``error``
        set on failure). In ``pd_separate`` a route whose prefill side is None has the decode
        worker prefill it itself. The run's phase and workers follow the stream.

        However the stream ends (finished, failed, or closed early by the caller), every worker
        that may still hold the attempt is told to drop it unless it ended cleanly there.
        """
        clean = False
        if run.attempt.owner != self.fleet.coordinator_id:  # each attempt names this coordinator
            run.attempt = replace(run.attempt, owner=self.fleet.coordinator_id)
        try:
            items, role = self._attempt(run)
            async for event in items:
                assert isinstance(event, TokenEvent)  # a hand-off's result never leaves here
                if event.queued_s is not None and self.on_prefilled is not None:
                    self.on_prefilled(role, event.queued_s, event.prefill_s or 0.0)
                if event.finish_reason == FinishReason.ERROR and run.aborted:
                    event = TokenEvent.aborted(run.attempt_id)  # the caller's abort, not a failure
                # ended where it ran, with nothing left on any worker
                clean = event.finished and event.finish_reason not in _UNCLEAN
                yield event
        finally:
            if clean:
                run.workers = []
            else:
                await self._release(run)

    def _attempt(self, run: RequestRun) -> tuple[AsyncIterator[StreamItem], str]:
        """The events of ``run``'s attempt, and the role of the worker computing its prompt."""
        if run.route is None:
            raise ValueError(f"request {run.request_id} streams before it was routed")
        prefill, decode = run.route
        if run.aborted:  # between two attempts
            return _aborted(run), "none"
        if self.config.deploy_mode == "single_node":
            colocated = ("colocated", decode % len(self.fleet.colocated))
            return self._generate_alone(run, colocated), "colocated"
        d_key = self.fleet.key("decode", decode)
        if prefill is None:
            limit = self._max_output_tokens(run)
            return self._generate_alone(run, d_key, limit), "decode"
        return self._generate_pd(run, self.fleet.key("prefill", prefill), d_key), "prefill"

    def _max_output_tokens(self, run: RequestRun) -> int:
        """A disaggregated request's output limit, whichever path it takes (token-accounting)."""
        max_new_tokens = run.request.params.max_new_tokens
        return output_limit(
            max_new_tokens, self.config.engine.scheduler.max_iter_times, disaggregated=True
        )

    async def _generate_pd(
        self, run: RequestRun, p_key: WorkerKey, d_key: WorkerKey
    ) -> AsyncIterator[StreamItem]:
        request, max_output_tokens = run.attempt, self._max_output_tokens(run)
        run.workers = [self.fleet.worker(*p_key), self.fleet.worker(*d_key)]
        streams = self.fleet.streams
        # the decode worker's items may come as soon as it holds the reservation
        with (
            _opened(streams, run.attempt_id, p_key) as first,
            _opened(streams, run.attempt_id, d_key) as rest,
        ):
            # the first token is the last: it ends on the prefill worker, no pages move
            target = HandoffTarget.nowhere(max_output_tokens)
            if max_output_tokens > len(request.output_token_ids) + 1:
                # the prefill worker's channel first: a reservation's clock runs from here
                await self._channel_up(p_key)
                # the first token's limit counts from the request's creation, once
                since = run.created_at if run.first_token_at is None else time.monotonic()
                reservation = await self._reserve(d_key, request, max_output_tokens, since)
                if not reservation.granted:
                    refusal = f"decode worker refused: {reservation.reason}"
                    cause = POOL_FULL if reservation.full else "reservation_refused"
                    cause = WORKER_RESTARTING if reservation.restarting else cause
                    cause = reservation.cause or cause  # role_switch: it serves prefill now
                    run.retry_after_s = reservation.retry_after_s
                    yield TokenEvent.failure(run.attempt_id, refusal, cause)
                    return
                target = HandoffTarget.from_reservation(reservation, max_output_tokens)
            if run.aborted:  # aborted while its blocks were being reserved
                yield TokenEvent.aborted(run.attempt_id)
                return
            # how long a grant takes to its first token: the reservation queue's estimates
            queue = self._reserve_queues.get(d_key) if target.hands_off else None
            granted_at = time.monotonic()
            async for item in self._prefill_then_decode(run, first, rest, target):
                if queue is not None and isinstance(item, TokenEvent):
                    queue.settled(time.monotonic() - granted_at)
                    queue = None
                yield item

    async def _prefill_then_decode(
        self, run: RequestRun, first: TokenStream, rest: TokenStream, target: HandoffTarget
    ) -> AsyncIterator[StreamItem]:
        run.advance(RunPhase.PREFILLING)
        handoff: HandoffResult | None = None
        async for item in self._prefilled(run, first, target):
            if isinstance(item, HandoffResult):
                handoff = item
                break
            yield item
        if handoff is not None:
            async for event in self._handed_off(run, rest, handoff):
                yield event

    async def _prefilled(
        self, run: RequestRun, stream: TokenStream, target: HandoffTarget
    ) -> AsyncIterator[StreamItem]:
        """The prefill worker's items: the first token, then the hand-off's result (none when
        the request ended on that token, or failed)."""
        p_worker = self.fleet.worker(*stream.worker)
        if run.pull is not None:  # leading blocks a peer holds, pulled first (kv_peer_pull)
            await self._pull(run, p_worker, run.pull)
        gate = self.fleet.gate(stream.worker)
        await self._submit(stream, lambda: p_worker.prefill.remote(run.attempt, target, **gate))
        async for item in stream:
            if isinstance(item, TokenEvent) and not item.finished:
                run.advance(RunPhase.HANDING_OFF)  # the first token: the pages go now
            elif isinstance(item, TokenEvent) and target.hands_off:
                await self._release(run)  # ended on its first token: free the reservation
            yield item

    async def _pull(self, run: RequestRun, puller: Any, plan: PullPlan) -> None:
        timeout_s = self.config.kv.transfer_timeout_s
        source = self.fleet.worker(*plan.source)
        tokens, tenant = run.all_token_ids, run.request.tenant
        outcome = await pull_prefix(puller, source, plan, tokens, tenant, timeout_s)
        if outcome is not None and self.on_pull is not None:
            self.on_pull(outcome)

    async def _handed_off(
        self, run: RequestRun, stream: TokenStream, handoff: HandoffResult
    ) -> AsyncIterator[StreamItem]:
        """After the hand-off: its failure, or the decode worker's events."""
        if not handoff.ok:
            error = handoff.error or "KV hand-off failed"
            yield TokenEvent.failure(run.attempt_id, error, "handoff_failed")
            return
        if self.on_handoff is not None:
            self.on_handoff(handoff.num_bytes, handoff.transfer_seconds, handoff.path)
        run.workers = [self.fleet.worker(*stream.worker)]
        run.advance(RunPhase.DECODING)
        async for event in stream:
            yield event

    async def _generate_alone(
        self, run: RequestRun, key: WorkerKey, *args: Any
    ) -> AsyncIterator[StreamItem]:
        """One worker computes the prompt and decodes: the colocated one, or a decode worker
        prefilling itself (``args``: its output limit)."""
        worker = self.fleet.worker(*key)
        run.workers = [worker]
        run.advance(RunPhase.PREFILLING)
        gate = self.fleet.gate(key)
        with _opened(self.fleet.streams, run.attempt_id, key) as stream:
            await self._submit(stream, lambda: worker.generate.remote(run.attempt, *args, **gate))
            async for event in stream:
                if isinstance(event, TokenEvent) and event.token_id is not None:
                    run.advance(RunPhase.DECODING)
                yield event

    async def _submit(self, stream: TokenStream, call: Callable[[], Awaitable[Submitted]]) -> None:
        """Send a request to ``stream``'s worker with ``call`` (attaching to its token channel
        first when it asks); a refusal or a lost worker ends ``stream`` with the failure."""
        try:
            submitted = await self._attached(stream.worker, call)
        except (ray.exceptions.RayError, TokenChannelError) as exc:
            error = f"worker failed: {type(exc).__name__}: {exc}"[:500]
            stream.end(TokenEvent.failure(stream.request_id, error, _lost_cause(exc)))
            return
        if not submitted.accepted:
            error = submitted.error or "not accepted"
            stream.end(TokenEvent.failure(stream.request_id, error, submitted.cause))

    async def _attached(self, key: WorkerKey, call: Callable[[], Awaitable[A]]) -> A:
        """``call``'s answer, attached first to worker ``key``'s token channel (``_channel_up``);
        if the worker says this coordinator is not attached there (it restarted elsewhere),
        attach where it says and call once more."""
        await self._channel_up(key)
        answer = await call()
        if answer.channel and not _accepted(answer):
            await self.fleet.attach(key, answer.channel, refused=True)
            answer = await call()
        return answer

    async def _channel_up(self, key: WorkerKey) -> None:
        """Attach to worker ``key``'s token channel where the fleet's identity says, unless it
        is up (an attach under way is waited for). One that fails means the identity is stale
        (the actor restarted): the worker is asked who it is now, so the next try goes where
        its channel is."""
        if self.fleet.streams.connected(key):
            return
        try:
            await self.fleet.attach(key)
        except TokenChannelError:
            await self.fleet.identify(key)

    def _reserve_queue(self, d_key: WorkerKey) -> ReserveQueue:
        return self._reserve_queues.setdefault(d_key, ReserveQueue(MAX_WAITING_RESERVATIONS))

    def share_places(self, reports: list[WorkerReport]) -> None:
        """Each decode worker's waiting places shared among the coordinators that hold a lease
        on it, as a load poll reports them: this one keeps out only its share."""
        for report in reports:
            load = report.load
            if load.role != "prefill":
                share = share_of_places(MAX_WAITING_RESERVATIONS, report.num_coordinators)
                self._reserve_queue((load.role, load.instance)).resize(share)

    async def _reserve(
        self,
        d_key: WorkerKey,
        request: GenerationRequest,
        max_output_tokens: int,
        since: float | None = None,
    ) -> Reservation:
        """Blocks on the decode worker ``d_key`` for a request decoding up to
        ``max_output_tokens``, waiting for room (in this coordinator's queue for the worker,
        then at the worker) no longer than the request may take counting from ``since``
        (``time.monotonic()``; default now)."""
        wait_s = min(x for x in (self.config.reservation_wait_s, request.timeout_s) if x)
        deadline = (time.monotonic() if since is None else since) + wait_s
        d_worker, gate = self.fleet.worker(*d_key), self.fleet.gate(d_key)
        queue = self._reserve_queue(d_key)
        try:
            async with queue.place(request.priority, deadline):
                left_s = max(deadline - time.monotonic(), 0.0)
                reservation = await self._attached(
                    d_key,
                    lambda: d_worker.reserve.remote(request, left_s, max_output_tokens, **gate),
                )
                queue.answered(reservation.granted)
                return reservation
        except Late as late:
            return Reservation.no_room(str(late), late.retry_after_s)
        except (ray.exceptions.RayError, TokenChannelError) as exc:
            if isinstance(exc, ray.exceptions.ActorUnavailableError):
                return Reservation(False, reason=type(exc).__name__, restarting=True)
            return Reservation.refused(type(exc).__name__)

    async def _release(self, run: RequestRun) -> None:
        """Tell every worker that may hold ``run``'s attempt to drop it (from now on it is held
        nowhere), in a task of its own that goes on when the caller is cancelled; the caller
        waits for it at most ``RELEASE_WAIT_S``."""
        workers, run.workers = run.workers, []
        if not workers:
            return
        task = asyncio.ensure_future(_abort_on(workers, run.attempt_id, self.fleet.coordinator_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), RELEASE_WAIT_S)

    async def abort(self, run: RequestRun) -> None:
        """End ``run`` in flight: its stream ends with ``abort`` wherever it is."""
        run.abort()
        await _abort_on(list(run.workers), run.attempt_id, self.fleet.coordinator_id)


async def _aborted(run: RequestRun) -> AsyncIterator[TokenEvent]:
    yield TokenEvent.aborted(run.attempt_id)


@contextlib.contextmanager
def _opened(streams: TokenStreams, request_id: str, key: WorkerKey) -> Iterator[TokenStream]:
    """``request_id``'s stream from worker ``key``, closed however the caller leaves."""
    stream = streams.open(request_id, key)
    try:
        yield stream
    finally:
        streams.close(stream)


def _lost_cause(exc: Exception) -> str:
    """A call that found its actor restarting (back once Ray has started it again) or gone."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return WORKER_RESTARTING
    return "worker_lost"


def _accepted(answer: Submitted | Reservation) -> bool:
    return answer.accepted if isinstance(answer, Submitted) else answer.granted


async def _abort_on(workers: list[Any], request_id: str, owner: str) -> None:
    """Abort ``request_id`` on every worker at once (idempotent; dead workers hold nothing);
    ``owner``: this coordinator (the call renews its lease there)."""
    calls = [worker.abort.remote(request_id, owner) for worker in workers]
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, Exception) and not isinstance(outcome, ray.exceptions.RayError):
            log.warning("abort of %s failed: %r", request_id, outcome)
