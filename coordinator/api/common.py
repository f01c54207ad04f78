"""What every front door shares: the served model as the doors see it, the JSON body reader with
its size limit, the one error type they raise, and the two forms of an answer (streamed or whole).

A refused or failed request is an :class:`APIError`: an HTTP status and a message; each protocol
shapes its body. A service error carries its own status (:mod:`coordinator.errors`), and
:meth:`APIError.from_service` is the one place that turns it into an answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from coordinator.errors import ServiceError
from coordinator.inference import first_event
from engine.outputs import TokenEvent

Events = AsyncGenerator[TokenEvent, None]


@dataclass
class ModelInfo:
    """What the front doors need to know of the served model."""

    name: str
    tokenizer: Any
    max_position_embeddings: int
    vocab_size: int
    max_input_tokens: int  # min(maxInputTokenLen, maxSeqLen - 1, max_position_embeddings, 1 Mi)
    full_text_enabled: bool = False
    modalities: tuple[str, ...] = ("text",)
    allowed_media_dirs: tuple[str, ...] = ()
    content_filter: Any = None  # a ContentFilter when content_safety is enabled


class APIError(Exception):
    """A request answered with an error status before its answer began. ``code`` names the
    failure where it has a name of its own (a service error's class, ``content_filter``)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    @classmethod
    def from_service(cls, exc: ServiceError) -> APIError:
        """A service error, answered with the HTTP status it carries."""
        return cls(exc.status, str(exc), type(exc).__name__)


OnError = Callable[[APIError], Response]
Handler = Callable[..., Awaitable[Response]]
Route = tuple[str, str, Handler]  # (method, path, handler)


class Answer(Protocol):
    """A front door's accumulator of one generation's events."""

    def add(self, event: TokenEvent) -> bool:
        """Take an event; True when the answer is complete and the generation should stop."""
        ...

    def stream(self, first: TokenEvent, events: Events) -> AsyncIterator[bytes]:
        """The SSE chunks, from the first event on; closes ``events``."""
        ...

    def body(self) -> Any:
        """The whole answer, as JSON."""
        ...


def create_router(*routes: Route, prefixes: tuple[str, ...] = ("",)) -> APIRouter:
    """A router of ``(method, path, handler)`` routes, each mounted under every prefix."""
    router = APIRouter()
    for prefix in prefixes:
        for method, path, handler in routes:
            router.add_api_route(prefix + path, handler, methods=[method])
    return router


async def read_json(request: Request, body_limit_mb: int) -> Any:
    """The decoded body: 413 over ``body_limit_mb``, 400 when it is not JSON."""
    body = await request.body()
    if len(body) > body_limit_mb * 1024 * 1024:
        raise APIError(
            413, f"request body of {len(body)} bytes is over the limit of {body_limit_mb} MB"
        )
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}") from exc


async def read_object(request: Request, body_limit_mb: int) -> dict[str, Any]:
    """:func:`read_json`, and 400 unless the body is a JSON object."""
    body = await read_json(request, body_limit_mb)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def open_stream(
    events: Events,
    chunks: Callable[[TokenEvent, Events], AsyncIterator[bytes]],
    on_error: OnError,
) -> Response:
    """An SSE response once the first event is there; a service error before it still gets its
    HTTP status (shaped by ``on_error``)."""
    try:
        first = await first_event(events)
    except ServiceError as exc:
        return on_error(APIError.from_service(exc))
    return StreamingResponse(chunks(first, events), media_type="text/event-stream")


async def collect(events: Events, answer: Answer) -> None:
    """Feed every event to ``answer`` until it is complete (closing the events aborts the rest of
    the generation). Service errors propagate."""
    try:
        async for event in events:
            if answer.add(event):
                break
    finally:
        await events.aclose()


async def respond(events: Events, answer: Answer, stream: bool, on_error: OnError) -> Response:
    """Answer a generation streamed or whole; ``on_error`` shapes a service error that happens
    before anything was sent."""
    if stream:
        return await open_stream(events, answer.stream, on_error)
    try:
        await collect(events, answer)
    except ServiceError as exc:
        return on_error(APIError.from_service(exc))
    return JSONResponse(answer.body())
