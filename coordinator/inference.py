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
logged with its cause and counted in ``request_migrations_total{reason}``.

A request that cannot be completed is never reported as finished: the stream raises a
:class:`ServiceError` (:class:`GenerationFailed` once the migrations are used up,
:class:`NoWorkerError` when no pair can take it at all), before or after events were yielded, and
``request_failed_total{reason}`` counts it. A timeout (the request's own, or
``exception_config``'s) aborts it on every worker and raises :class:`RequestTimeout`; a client that
goes away cancels us, which aborts it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from coordinator.errors import (
    GenerationFailed,
    NoWorkerError,
    RequestTimeout,
    TooManyRequests,
)
from coordinator.metrics import Metrics
from coordinator.router import Route, Router
from engine.outputs import TokenEvent
from engine.request import FinishReason
from workers.contracts import GenerationRequest

log = logging.getLogger(__name__)
REPICK_INTERVAL_S = 0.25  # a migrating request's wait between tries for a pair


@dataclass(frozen=True)
class Timeouts:
    """Seconds; 0 = off. ``request`` is the body's ``timeout`` parameter."""

    schedule: float = 600
    first_token: float = 600
    infer: float = 600
    request: float = 600


class InferenceService:
    def __init__(
        self,
        cluster,
        router: Router,
        max_requests: int,
        max_retry: int,
        timeouts: Timeouts,
        metrics: Metrics | None = None,
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.router = router
        self.max_requests = max_requests
        self.max_retry = max_retry
        self.timeouts = timeouts
        self.in_flight = 0
        self.draining = False
        self._ids = itertools.count()

    def new_request_id(self) -> str:
        """Unique and unguessable: a counter and 64 random bits."""
        return f"req-{next(self._ids):x}-{secrets.token_hex(8)}"

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Token events up to the finished one; raises on timeout or unrecoverable failure."""
        metrics = self.metrics
        if metrics:
            metrics.received.labels(metrics.model_name).inc()
        if self.draining or self.in_flight >= self.max_requests:
            self._failed("unavailable" if self.draining else "too_many_requests")
            if self.draining:
                raise NoWorkerError("the coordinator is shutting down")
            raise TooManyRequests(
                f"{self.in_flight} requests in flight (max_requests {self.max_requests})"
            )
        self.in_flight += 1
        start, first_at, outcome = time.monotonic(), None, "aborted"
        gauge = metrics.waiting.labels(metrics.model_name) if metrics else None
        if gauge:
            gauge.inc()
        try:
            async for event in self._with_timeouts(request):
                if first_at is None and event.token_id is not None:
                    first_at = time.monotonic()
                    gauge = self._move_gauge(gauge)
                if event.finished:
                    outcome = "ok" if event.finish_reason != FinishReason.ABORT else "aborted"
                    if metrics and outcome == "ok":
                        metrics.record_finished(
                            request.num_prompt_tokens,
                            event.num_output_tokens,
                            first_at - start if first_at else None,
                            time.monotonic() - start,
                        )
                yield event
        except RequestTimeout:
            outcome = "timeout"
            raise
        except NoWorkerError:
            outcome = "unavailable"
            raise
        except GenerationFailed:
            outcome = "error"
            raise
        finally:
            self.in_flight -= 1
            if gauge:
                gauge.dec()
            if outcome != "ok":
                self._failed(outcome)

    def _move_gauge(self, gauge):
        if gauge is None:
            return None
        gauge.dec()
        running = self.metrics.running.labels(self.metrics.model_name)
        running.inc()
        return running

    def _failed(self, reason: str) -> None:
        if self.metrics:
            self.metrics.failed.labels(self.metrics.model_name, reason).inc()

    async def _with_timeouts(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        start = time.monotonic()
        t = self.timeouts
        total = min(x for x in (request.timeout_s, t.infer or float("inf")) if x)
        total_message = "Request inference timeout"
        first = min(x for x in (t.first_token or float("inf"), t.schedule or float("inf"), total))
        first_message = (
            "Request first token timeout"
            if first == t.first_token
            else "Request schedule timeout"
            if first == t.schedule
            else total_message
        )
        events = self._with_migration(request)
        got_token = False
        try:
            while True:
                limit, message = (total, total_message) if got_token else (first, first_message)
                remaining = limit - (time.monotonic() - start)
                try:
                    event = await asyncio.wait_for(events.__anext__(), max(remaining, 0.001))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise RequestTimeout(message) from None
                got_token = got_token or event.token_id is not None
                yield event
                if event.finished:
                    return
        finally:
            await events.aclose()

    async def _with_migration(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """The request's events from one pair after another, as one stream (module docstring)."""
        request_id = request.request_id
        generated: list[int] = []  # every token yielded so far
        failed: Route | None = None
        migration = 0
        while True:
            tokens = [*request.prompt_token_ids, *request.output_token_ids, *generated]
            pair = await self._pair(tokens, failed)
            attempt = (
                request
                if migration == 0
                else request.continued(f"{request_id}-m{migration}", generated)
            )
            failure = None
            events = self.cluster.generate(attempt, prefill=pair[0], decode=pair[1])
            async with contextlib.aclosing(events):  # a failed attempt is released at once
                async for event in events:
                    if event.finish_reason == FinishReason.ERROR:
                        failure = event
                        break
                    if event.token_id is not None:
                        generated.append(event.token_id)
                    event.request_id = request_id
                    yield event
                    if event.finished:
                        return
            cause, error = _failure(failure)
            if migration == self.max_retry:
                raise GenerationFailed(
                    f"request failed after {self.max_retry} migrations: {cause}: {error}"
                )
            log.warning(
                "request %s: migrating after %d tokens off pair %s (%s): %s",
                request_id,
                len(generated),
                pair,
                cause,
                error,
            )
            if self.metrics:
                self.metrics.migrations.labels(self.metrics.model_name, cause).inc()
            failed, migration = pair, migration + 1

    async def _pair(self, token_ids: Sequence[int], failed: Route | None) -> Route:
        """A pair for a request that computes ``token_ids`` (prompt and outputs so far), new
        (NoWorkerError if none) or migrating off ``failed``: another pair if there is one, else
        the same pair (its actor restarted), waiting for one to come back if need be (the
        request's timeouts bound the wait)."""
        while True:
            try:
                return self.router.choose(
                    token_ids, {failed} if failed is not None else frozenset()
                )
            except NoWorkerError:
                if failed is None:
                    raise
            try:
                return self.router.choose(token_ids)
            except NoWorkerError:
                await asyncio.sleep(REPICK_INTERVAL_S)


def _failure(event: TokenEvent | None) -> tuple[str, str]:
    """(cause, message) of a failed attempt; None: its stream ended without a last event."""
    if event is None:
        return "worker_lost", "the worker stream ended before the request finished"
    return event.cause or "engine_error", event.error or "generation failed"
