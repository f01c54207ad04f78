"""Runs one request on the cluster for any front door: admission, routing, migration, timeouts.

Life of a request here: admitted under ``max_requests`` (else :class:`TooManyRequests`) → a
(prefill, decode) pair is chosen by load → its token events are relayed as they come.

When its pair fails (a worker dies, a reservation is refused, a hand-off fails or times out, a
transport breaks), before or after tokens reached the client, the request migrates: the prompt
plus every token generated so far goes to a healthy pair (or the restarted actor), which computes
them and continues after them, and the same stream goes on. No token is repeated or lost, the
token accounting is the same, greedy output is token-identical to an uninterrupted run, and a
seeded request draws the same tokens (each token's seed comes from the request's seed and its
position: ``engine.sampler``). A request migrates at most ``max_retry`` times; each migration is
logged with its cause and counted in ``request_migrations_total{reason}``. A decode worker that
had no room for it (every block taken for as long as it could wait, or as many hand-offs waiting
there as it lets wait) is no fault: the request is refused at once (:class:`TooManyRequests`,
429), as the pool is full, rather than queued until it times out. A request whose output cannot
follow its constraint (cause ``constraint_violated``: the same on any pair) fails at once with
:class:`ConstraintViolated` (422), never migrated.

A request that cannot be completed is never reported as finished: the stream raises a
:class:`ServiceError` (:class:`GenerationFailed` once the migrations are used up, its message
naming the request id and the cause's kind only: the worker's error, which may hold Ray's text,
node addresses and KV ports, is logged under that id; :class:`NoWorkerError` when no pair can
take it at all), before or after events were yielded, and ``request_failed_total{reason}``
counts it. A timeout (the request's own, or
``exception_config``'s) aborts it on every worker and raises :class:`RequestTimeout`; a client that
goes away cancels us, which aborts it the same way.

The request's state lives in its :class:`~coordinator.request_run.RequestRun`, which the service
creates at admission and hands to the cluster for each attempt; ``runs`` indexes the live ones by
id (``abort``), and every way a request ends (finish, failure, timeout, cancellation) takes it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from coordinator.cluster import POOL_FULL, WORKER_RESTARTING
from coordinator.errors import (
    ConstraintViolated,
    GenerationFailed,
    NoWorkerError,
    RequestTimeout,
    ServiceError,
    TooManyRequests,
    check_room,
    retry_after,
)
from coordinator.metrics import Metrics
from coordinator.planner.traffic import TrafficWindow
from coordinator.pool.token_stream import SLOW_CLIENT
from coordinator.request_deadline import Deadline
from coordinator.request_run import Outcome, RequestRun
from coordinator.router import Router
from coordinator.routing.choice import Route
from engine.outputs import CONSTRAINT_VIOLATED, TokenEvent
from engine.request import FinishReason
from workers.contracts import ROLE_SWITCH, GenerationRequest

log = logging.getLogger(__name__)
REPICK_INTERVAL_S = 0.25  # a migrating request's wait between tries for a pair
_RAISED = (  # the errors a request's stream raises, and the outcome each one counts as
    (RequestTimeout, Outcome.TIMEOUT),
    (NoWorkerError, Outcome.UNAVAILABLE),
    (GenerationFailed, Outcome.ERROR),
    (TooManyRequests, Outcome.TOO_MANY_REQUESTS),
)


@dataclass(frozen=True)
class Timeouts:
    """Seconds; 0 = off. ``request`` is the body's ``timeout`` parameter."""

    schedule: float = 600
    first_token: float = 600
    infer: float = 600
    request: float = 600

    def limits(self, request: GenerationRequest) -> tuple[tuple[float, str], tuple[float, str]]:
        """(seconds, message) until the first token, and until the end, for ``request``."""
        total = min(x for x in (request.timeout_s, self.infer or float("inf")) if x)
        total_message = "Request inference timeout"
        first = min(self.first_token or float("inf"), self.schedule or float("inf"), total)
        first_message = (
            "Request first token timeout"
            if first == self.first_token
            else "Request schedule timeout"
            if first == self.schedule
            else total_message
        )
        return (first, first_message), (total, total_message)


@dataclass(eq=False)
class InferenceService:
    cluster: Any  # coordinator.cluster.Cluster
    router: Router
    max_requests: int
    max_retry: int
    timeouts: Timeouts
    metrics: Metrics | None = None
    # what the role planner learns of the traffic (coordinator/planner/traffic.py), if it runs
    traffic: TrafficWindow | None = None
    in_flight: int = field(default=0, init=False)  # generations and embeddings (api.admission)
    draining: bool = field(default=False, init=False)
    runs: dict[str, RequestRun] = field(default_factory=dict, init=False)  # live ones, by id
    _ids: Iterator[int] = field(default_factory=itertools.count, init=False)

    def new_request_id(self) -> str:
        """Unique and unguessable: a counter and 64 random bits."""
        return f"req-{next(self._ids):x}-{secrets.token_hex(8)}"

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Token events up to the finished one; raises on timeout or unrecoverable failure."""
        run = RequestRun(request)
        self._admit(run)
        try:
            async for event in self._with_timeouts(run):
                self._relay(run, event)
                yield event
        except (RequestTimeout, NoWorkerError, GenerationFailed, TooManyRequests) as exc:
            run.end(next(outcome for kind, outcome in _RAISED if isinstance(exc, kind)))
            raise
        finally:
            self._leave(run)

    async def abort(self, request_id: str) -> bool:
        """Abort the live request ``request_id`` wherever it is: its stream ends with ``abort``
        (False: no such request)."""
        run = self.runs.get(request_id)
        if run is None:
            return False
        run.abort()
        await self.cluster.abort(run)
        return True

    def _admit(self, run: RequestRun) -> None:
        """Take ``run`` in (registered, counted waiting), or end it and raise why not."""
        if self.metrics:
            self.metrics.received.labels(self.metrics.model_name).inc()
            constraint = run.request.params.constraint
            if constraint is not None:
                self.metrics.constrained.labels(self.metrics.model_name, constraint.kind).inc()
        try:
            check_room(self.draining, self.in_flight, self.max_requests, "in flight")
        except ServiceError:
            run.end(Outcome.UNAVAILABLE if self.draining else Outcome.TOO_MANY_REQUESTS)
            self._failed(run.outcome)
            raise
        self.in_flight += 1
        self.runs[run.request_id] = run
        self._gauge(run, +1)
        if self.traffic is not None:
            self.traffic.arrived(run.request.num_prompt_tokens)

    def count_refusal(self) -> None:
        """A request refused before it reached this service (by the door gate before its body
        was read, coordinator/api/admission.py, or by its client's limits,
        coordinator/api/clients.py): received and failed, as one this service refuses."""
        if self.metrics:
            self.metrics.received.labels(self.metrics.model_name).inc()
        self._failed(Outcome.UNAVAILABLE if self.draining else Outcome.TOO_MANY_REQUESTS)

    def _relay(self, run: RequestRun, event: TokenEvent) -> None:
        """``event`` goes to the client now: the run's next token (its first moves it from the
        waiting gauge to the running one), or its finish (counted)."""
        waiting = run.first_token_at is None
        run.record(event)
        if self.metrics and waiting and run.first_token_at is not None:
            self.metrics.waiting.labels(self.metrics.model_name).dec()
            self.metrics.running.labels(self.metrics.model_name).inc()
        if event.finished:
            run.end(Outcome.OK if event.finish_reason != FinishReason.ABORT else Outcome.ABORTED)
        if self.metrics and event.finished and run.outcome == Outcome.OK:
            _record_finished(self.metrics, run, event.num_output_tokens)
        if self.traffic is not None and event.finished and run.outcome == Outcome.OK:
            _record_traffic(self.traffic, run, event.num_output_tokens)

    def _leave(self, run: RequestRun) -> None:
        """``run`` is over: out of the registry and the gauges; counted unless it finished."""
        run.end(Outcome.ABORTED)  # nothing else ended it: cancelled, or the caller closed it
        self.router.release(run.request_id)
        self.in_flight -= 1
        if self.runs.get(run.request_id) is run:
            del self.runs[run.request_id]
        self._gauge(run, -1)
        if run.outcome != Outcome.OK:
            self._failed(run.outcome)

    def _gauge(self, run: RequestRun, change: int) -> None:
        """Move the gauge of ``run``'s state: waiting until its first token, then running."""
        if self.metrics is None:
            return
        gauge = self.metrics.running if run.first_token_at is not None else self.metrics.waiting
        gauge.labels(self.metrics.model_name).inc(change)

    def _failed(self, reason: str | None) -> None:
        if self.metrics:
            self.metrics.failed.labels(self.metrics.model_name, reason).inc()

    async def _with_timeouts(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        """The run's events, its waits for them timed to its limits (a timer per limit, only
        the waits timed: ``coordinator/request_deadline.py``)."""
        first, total = self.timeouts.limits(run.request)
        events = self._with_migration(run)
        deadline = Deadline(run.created_at)
        try:
            while True:
                deadline.set(*(total if run.first_token_at is not None else first))
                try:
                    event = await deadline.wait(events)
                except StopAsyncIteration:
                    return
                yield event
                if event.finished:
                    return
        finally:
            deadline.clear()
            await events.aclose()

    async def _with_migration(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        """The run's events from one pair after another, as one stream (module docstring)."""
        while True:
            run.route_to(await self._pair(run))
            run.pull = self.router.take_pull(run.request_id)
            failure = None
            async with contextlib.aclosing(self.cluster.stream(run)) as events:
                async for event in events:  # a failed attempt is released at once
                    if event.cause == SLOW_CLIENT:
                        self._slow_client(run, event)
                    if event.cause == POOL_FULL:
                        no_room = "no room for the request in the pool now"
                        raise TooManyRequests(no_room, retry_after(run.retry_after_s))
                    if event.cause == CONSTRAINT_VIOLATED:
                        _constraint_violated(run, event)
                    if event.finish_reason == FinishReason.ERROR:
                        failure = event
                        break
                    event.request_id = run.request_id
                    yield event
                    if event.finished:
                        return
            self._migrate(run, *_failure(failure))

    def _slow_client(self, run: RequestRun, event: TokenEvent) -> None:
        """``run``'s client left too many events unread: it ends (aborted on its workers as a
        failed attempt is), never migrates."""
        if self.metrics:
            self.metrics.slow_clients.labels(self.metrics.model_name).inc()
        raise GenerationFailed(f"request {run.request_id}: {event.error}")

    def _migrate(self, run: RequestRun, cause: str, error: str) -> None:
        """Send ``run`` back for another pair, or raise GenerationFailed if it may not. An
        attempt that found its worker restarting spends no retry: the next pick waits for a
        pair that answers (the request's timeouts bound it); nor does one its worker handed on
        by switching roles (``role_switch``: a move, not a failure, counted apart)."""
        spent = cause not in (WORKER_RESTARTING, ROLE_SWITCH)
        if spent and run.num_spent == self.max_retry:
            # the detail (a worker's error, Ray's text, a node's address) is logged, not sent
            log.error(
                "request %s failed after %d migrations: %s: %s",
                run.request_id,
                self.max_retry,
                cause,
                error,
            )
            raise GenerationFailed(
                f"request {run.request_id} failed after {self.max_retry} migrations: {cause}"
            )
        log.warning(
            "request %s: migrating after %d tokens off pair %s (%s): %s",
            run.request_id,
            len(run.output_token_ids),
            run.route,
            cause,
            error,
        )
        if self.metrics and cause == ROLE_SWITCH:
            self.metrics.role_metrics().migrated()
        elif self.metrics and (spent or not run.migrations):  # restarting: a first only
            self.metrics.migrations.labels(self.metrics.model_name, cause).inc()
        run.migrate(cause, spent)

    async def _pair(self, run: RequestRun) -> Route:
        """A pair for ``run`` (to compute its prompt and outputs so far), new (NoWorkerError if
        none, TooManyRequests if every worker holds all the requests it may) or migrating off
        its failed pair: another pair if there is one, else the same pair (its actor restarted),
        waiting for one to come back if need be (the request's timeouts bound the wait; an abort
        ends it: the failed pair is taken back, and its stream ends at once as aborted)."""
        token_ids, failed, tenant = run.all_token_ids, run.failed_route, run.request.tenant
        holder = run.request_id
        last = run.migrations[-1] if run.migrations else None
        if last is not None and last.cause == ROLE_SWITCH:
            await self.router.view.refresh_roles()  # its worker switched: where is what now
        elif last is not None and not last.spent:
            await asyncio.sleep(REPICK_INTERVAL_S)  # its worker is restarting: give it a moment
        while True:
            try:
                if failed is None:
                    return self.router.choose(token_ids, tenant=tenant, holder=holder)
                return self.router.choose(token_ids, {failed}, tenant, False, holder)
            except NoWorkerError:
                if failed is None:
                    raise
            try:
                return self.router.choose(token_ids, tenant=tenant, capped=False, holder=holder)
            except NoWorkerError:
                if run.aborted:
                    return failed
                await asyncio.sleep(REPICK_INTERVAL_S)


def _constraint_violated(run: RequestRun, event: TokenEvent) -> None:
    """``run``'s output cannot follow its constraint: the same on any pair, so it ends now
    (aborted on its workers as a failed attempt is), never migrates."""
    log.warning("request %s: %s: %s", run.request_id, CONSTRAINT_VIOLATED, event.error)
    raise ConstraintViolated(
        f"request {run.request_id} failed: {CONSTRAINT_VIOLATED}: "
        f"{event.error or 'the output does not match its constraint'}"
    )


def _record_finished(metrics: Metrics, run: RequestRun, num_output_tokens: int) -> None:
    first = run.first_token_at
    metrics.record_finished(
        run.request.num_prompt_tokens,
        num_output_tokens,
        first - run.created_at if first else None,
        time.monotonic() - run.created_at,
    )


def _record_traffic(traffic: TrafficWindow, run: RequestRun, num_output_tokens: int) -> None:
    first = run.first_token_at
    ttft = first - run.created_at if first is not None else None
    itl = None
    if first is not None and num_output_tokens > 1:
        itl = (time.monotonic() - first) / (num_output_tokens - 1)
    traffic.finished(num_output_tokens, ttft, itl)


def _failure(event: TokenEvent | None) -> tuple[str, str]:
    """(cause, message) of a failed attempt; None: its stream ended without a last event."""
    if event is None:
        return "worker_lost", "the worker stream ended before the request finished"
    return event.cause or "engine_error", event.error or "generation failed"
