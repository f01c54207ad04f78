"""MindIE ``/infer`` response shapes: the text answer, the SSE events and the error body
``{"error", "error_type"}`` (see ``docs/api.md``).

A stream that fails after its first event ends with one last event like a normal last one, but
with ``details.finish_reason`` ``stop_sequence`` (``details`` is there even when not asked for),
an empty ``generated_text``, ``token`` null, and the failure in ``error`` and ``error_type``.

``details.cached_tokens`` is the count of prompt tokens whose KV came from a worker's prefix
cache, as the latest event with a token reports it (a migrated request's new pair reports its
own figure), never more than the prompt.

With content safety on, the generated text is checked as it grows, before any of it is sent: at a
match the answer is cut before it and ends there with ``finish_reason`` ``content_filter`` (a
stream's last event then carries the cut ``generated_text``; the first characters of a term
spanning two tokens may have been sent)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from coordinator.api.common import Events, chained
from coordinator.api.errors import APIError
from coordinator.api.sse import sse_event
from coordinator.content_safety import ContentFilter
from coordinator.errors import ServiceError
from engine.outputs import TokenEvent
from engine.request import FinishReason

FINISH_REASONS = {  # the normal finishes; a failure is raised, never a finish
    FinishReason.EOS: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop_sequence",
}
FAILED = "stop_sequence"  # the finish_reason of the error event that ends a failed stream
ERROR_TYPES = {
    400: "Bad Request",
    404: "NotFoundError",
    408: "Request Timeout",
    413: "Payload Too Large",
    422: "Input Validation Error",
    429: "Too many requests",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}


def sse(payload: dict[str, Any]) -> bytes:
    """One event, exactly ``data: <json>\\n\\n`` (compact JSON, UTF-8 kept as is)."""
    return sse_event(payload)


CONTENT_FILTER = "content_filter"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, ERROR_TYPES[500])


def error_body(error: APIError) -> dict[str, str]:
    """``{"error", "error_type"}``; a blocked input's type is ``content_filter``."""
    kind = CONTENT_FILTER if error.code == CONTENT_FILTER else error_type(error.status)
    return {"error": error.message, "error_type": kind}


def service_error(error: APIError) -> APIError:
    """MindIE's wording of a service failure: a timeout names the timeout that expired, a full
    house says only "Too many requests", any other failure leads with its error type."""
    if error.status == 408:
        return error
    if error.status == 429:
        return APIError(429, error_type(429), error.code, error.retry_after_s)
    message = f"{error_type(error.status)}: {error.message}"
    return APIError(error.status, message, error.code, error.retry_after_s)


@dataclass
class InferAnswer:
    """Accumulates one request's events into MindIE's shapes."""

    seed: int
    details: bool
    full_text: bool
    started_at: float  # time.monotonic() when the request arrived
    text: str = ""
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    content_filter: ContentFilter | None = None
    blocked: bool = False  # the content filter cut the answer: it ends now
    _last_at: float | None = field(default=None, repr=False)

    def details_body(self) -> dict[str, Any] | None:
        if not self.details:
            return None
        return self._details(self.finish_reason)

    def _details(self, finish_reason: str | None) -> dict[str, Any]:
        return {
            "finish_reason": finish_reason,
            "generated_tokens": self.num_tokens,
            "seed": self.seed,
            "cached_tokens": self.num_cached_tokens,
        }

    def add(self, event: TokenEvent) -> bool:
        """Take one event of a whole answer; complete at its finished event, or when the content
        filter cut it."""
        self.payload(event, time.monotonic())
        return self.blocked

    def _filter(self) -> None:
        """Cut the text before the content filter's first match, and end the answer there."""
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self.text = self.text[: match.start()]
            self.finish_reason, self.blocked = CONTENT_FILTER, True

    def payload(self, event: TokenEvent, now: float) -> dict[str, Any] | None:
        """Take one event; return the SSE payload for it (None for an event with no token, unless
        the content filter ends the answer on it)."""
        self.text += event.text
        if event.finish_reason is not None:
            self.finish_reason = FINISH_REASONS[event.finish_reason]
        self._filter()
        if event.token_id is None and not self.blocked:
            return None
        if event.token_id is not None:
            self.num_tokens += 1
        self.num_cached_tokens = min(event.num_cached_tokens, event.num_prompt_tokens)
        last_at = self._last_at
        times = {
            "prefill_time": round((now - self.started_at) * 1000, 3) if last_at is None else None,
            "decode_time": None if last_at is None else round((now - last_at) * 1000, 3),
        }
        self._last_at = now
        if event.finished or self.blocked:
            return {
                **times,
                "generated_text": self.text,
                "details": self.details_body(),
                "token": {"id": event.token_id, "text": None},
            }
        piece = self.text if self.full_text else event.text
        return {**times, "token": {"id": event.token_id, "text": piece}}

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"generated_text": self.text}
        if self.details:
            body["details"] = self.details_body()
        return body

    def failure_payload(self, error: APIError) -> dict[str, Any]:
        """The last event of a stream that failed after it began."""
        return {
            "prefill_time": None,
            "decode_time": None,
            "generated_text": "",
            "details": self._details(FAILED),
            "token": None,
            **error_body(error),
        }

    async def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        """SSE events; a failure after the headers went out becomes a final error event."""
        try:
            async for event in chained(first, events):
                payload = self.payload(event, time.monotonic())
                if payload is not None:
                    yield sse(payload)
                if self.blocked:
                    break
        except ServiceError as exc:
            yield sse(self.failure_payload(service_error(APIError.from_service(exc))))
        finally:
            await events.aclose()
