"""Runs one request on the cluster for any front door: admission, routing, retries, timeouts.

Life of a request here: admitted under ``max_requests`` (else :class:`TooManyRequests`) → a
(prefill, decode) pair is chosen by load → its token events are relayed as they come. A hand-off
that fails before any token reached the client is retried on another pair, up to ``max_retry``
times. A timeout (the request's own, or ``exception_config``'s) aborts it on every worker and
raises :class:`RequestTimeout`; so does a client that goes away (the caller cancels us).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from coordinator.errors import (
    GenerationFailed,
    NoWorkerError,
    RequestTimeout,
    ServiceError,
    TooManyRequests,
)
from coordinator.metrics import Metrics
from coordinator.router import Router
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.worker.contracts import GenerationRequest

log = logging.getLogger(__name__)


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
        return f"req-{time.time_ns():x}-{next(self._ids)}"

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
        except (GenerationFailed, NoWorkerError):
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
        events = self._with_retries(request)
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

    async def _with_retries(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        request_id = request.request_id
        tried: set[tuple[int, int]] = set()
        for attempt in range(self.max_retry + 1):
            try:
                pair = self.router.choose(request.num_prompt_tokens, tried)
            except NoWorkerError:
                if not tried:
                    raise
                tried.clear()  # every pair failed once: go round again
                pair = self.router.choose(request.num_prompt_tokens, tried)
            tried.add(pair)
            attempt_id = request_id if attempt == 0 else f"{request_id}-retry{attempt}"
            streamed = False
            async for event in self.cluster.generate(
                request.with_id(attempt_id), prefill=pair[0], decode=pair[1]
            ):
                if event.finish_reason == FinishReason.ERROR and not streamed:
                    log.warning(
                        "request %s: attempt %d on pair %s failed: %s",
                        request_id,
                        attempt,
                        pair,
                        event.error,
                    )
                    break
                streamed = True
                event.request_id = request_id
                yield event
                if event.finish_reason == FinishReason.ERROR:
                    raise GenerationFailed(event.error or "generation failed")
                if event.finished:
                    return
            else:
                return
        raise GenerationFailed(f"request failed after {self.max_retry + 1} attempts")


async def first_event(events: AsyncGenerator[TokenEvent, None]) -> TokenEvent:
    """The first event of a stream about to be answered; on a service error the stream is
    closed and the error raised, so the caller can still answer with an HTTP status."""
    try:
        return await events.__anext__()
    except ServiceError:
        await events.aclose()
        raise
