"""What every front door shares: the JSON body reader with its size limit, the one error type
they raise, and the two forms of an answer (streamed or whole). The served model as the doors
see it is :class:`coordinator.model_info.ModelInfo`.

A refused or failed request is an :class:`APIError`: an HTTP status and a message; each protocol
shapes its body. A service error carries its own status (:mod:`coordinator.errors`), and
:meth:`APIError.from_service` is the one place that turns it into an answer.

A generation's life here: the service's events pass through :func:`raising_failures`, so a request
that ends without completing always reaches a door as a raised :class:`ServiceError`, never as a
finish. :func:`respond` answers whole (:func:`collect`: every event, then the body, or the error
status; never partial text) or streamed (:func:`open_stream`: the first event decides between the
error status and a 200 stream; a failure after it is the door's own last error event). A client
that goes away cancels the handler (:mod:`~coordinator.api.middleware`); the cancellation closes
the events, which aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.api.clients import client_of
from coordinator.api.errors import APIError
from coordinator.api.tenants import tenant_of
from coordinator.errors import GenerationFailed, ServiceError
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest

log = logging.getLogger(__name__)
Events = AsyncGenerator[TokenEvent, None]
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape in JSON text
# a body over this is decoded on LARGE_JSON's thread, off the event loop (a 64 KiB body takes
# about half a millisecond to decode), one at a time (so one large body's objects at most are
# being built at once, whatever arrives)
LARGE_JSON_BYTES = 64 * 1024
LARGE_JSON = ThreadPoolExecutor(max_workers=1, thread_name_prefix="large-json")
CACHE_KEY_HEADER = "x-prompt-cache-key"  # a conversation's key at every door (sessions)


OnError = Callable[[APIError], Response]
Handler = Callable[..., Awaitable[Response]]
Route = tuple[str, str, Handler]  # (method, path, handler)


class Answer(Protocol):
    """A front door's accumulator of one generation's events."""

    def add(self, event: TokenEvent) -> bool:
        """Take an event; True when the answer is complete and the generation should stop."""
        ...

    def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        """The SSE chunks, from the first event on; closes ``events``."""
        ...

    def body(self) -> Any:
        """The whole answer, as JSON."""
        ...


@dataclass(eq=False)
class Door:
    """A generating front door's handlers over one service and model."""

    service: InferenceService
    model: ModelInfo
    body_limit_mb: int

    def generation(
        self, request: Request, ids: list[int], params: SamplingParams, **fields: Any
    ) -> Events:
        """The service's events for ``ids`` under a new request id, as the tenant of the HTTP
        ``request``, metered against its client's token rate; ``fields``: the rest of the
        :class:`GenerationRequest` (priority, clamped to what the client's key may ask; timeout;
        ``cache_key``: OpenAI's ``prompt_cache_key``, else the ``X-Prompt-Cache-Key`` header)."""
        client = client_of(request)
        if "priority" in fields:
            fields["priority"] = client.priority(fields["priority"])
        key = fields.pop("cache_key", None) or request.headers.get(CACHE_KEY_HEADER, "")
        new = GenerationRequest(
            self.service.new_request_id(),
            ids,
            params,
            tenant=tenant_of(request),
            client=client.key,
            cache_key=session_key(key),
            **fields,
        )
        constrained = params.constraint is not None
        return client.metered(self.service.generate(new), params.max_new_tokens, constrained)


def session_key(key: str) -> str:
    """What the workers are told of a conversation's key: a hash ("" for none)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def create_router(*routes: Route, prefixes: tuple[str, ...] = ("",)) -> APIRouter:
    """A router of ``(method, path, handler)`` routes, each mounted under every prefix."""
    router = APIRouter()
    for prefix in prefixes:
        for method, path, handler in routes:
            router.add_api_route(prefix + path, handler, methods=[method])
    return router


async def read_body(request: Request, limit: int, too_large: Callable[[str], Exception]) -> bytes:
    """The body, refused with ``too_large(its size)`` as soon as ``Content-Length`` or the bytes
    read so far are over ``limit`` bytes (the rest is never read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{declared} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(f"more than {limit} bytes")
    return bytes(body)


def body_too_large(size: str, body_limit_mb: int) -> APIError:
    return APIError(413, f"request body of {size} is over the limit of {body_limit_mb} MB")


async def read_json(request: Request, body_limit_mb: int) -> Any:
    """The decoded body: 413 over ``body_limit_mb``; 400 when it is not JSON (or not UTF-8/16/32,
    nested too deep, a number of too many digits); 422 when a string holds a lone surrogate
    (valid JSON, but no tokenizer or answer can take it)."""
    too_large = partial(body_too_large, body_limit_mb=body_limit_mb)
    body = await read_body(request, body_limit_mb * 1024 * 1024, too_large)
    try:
        if len(body) > LARGE_JSON_BYTES:
            loop = asyncio.get_running_loop()
            text, value = await loop.run_in_executor(LARGE_JSON, decode_json, body)
        else:
            text, value = decode_json(body)
    except RecursionError as exc:
        raise APIError(400, "malformed JSON: nested too deeply") from exc
    except ValueError as exc:  # not JSON, not UTF-8/16/32, or an integer of over 4300 digits
        raise APIError(400, f"malformed JSON: {exc}") from exc
    if SURROGATE_ESCAPE.search(text) and not utf8_encodable(value):
        raise APIError(
            422, "a string of the JSON body holds a lone surrogate (\\ud800-\\udfff): not Unicode"
        )
    return value


def decode_json(body: bytes) -> tuple[str, Any]:
    """The body's text and its decoded value (strict: no encoded surrogates)."""
    text = body.decode(json.detect_encoding(body))
    return text, json.loads(text)


def utf8_encodable(value: Any) -> bool:
    """Whether every string of a decoded JSON value can be encoded (no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


async def read_object(request: Request, body_limit_mb: int) -> dict[str, Any]:
    """:func:`read_json`, and 400 unless the body is a JSON object."""
    body = await read_json(request, body_limit_mb)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def new_error_id() -> str:
    """The id under which an unexpected failure is logged and answered."""
    return uuid.uuid4().hex[:16]


def internal_error_message(error_id: str) -> str:
    """What a client is told of an unexpected failure: nothing but the id it was logged under."""
    return f"Internal error; request id {error_id}"


async def raising_failures(events: Events) -> Events:
    """The service's events, with every way a request can end without completing raised as a
    :class:`ServiceError`: an ``error`` or ``abort`` finish (the service raises instead, and
    yields ``abort`` only for a client that is gone: a safeguard), an end without a finished
    event, or an unexpected exception (logged with an id; the client is told only the id).
    Closing this generator closes ``events``."""
    finished = False
    try:
        async for event in events:
            if event.finish_reason == FinishReason.ERROR:
                raise GenerationFailed(event.error or "the generation failed")
            if event.finish_reason == FinishReason.ABORT:
                raise GenerationFailed("the request was aborted")
            finished = event.finished
            yield event
    except Exception as exc:
        if isinstance(exc, ServiceError):
            raise
        error_id = new_error_id()
        log.exception("request failed in the service (request id %s)", error_id)
        raise GenerationFailed(internal_error_message(error_id)) from exc
    finally:
        await events.aclose()
    if not finished:
        raise GenerationFailed("the generation ended without a finish")


class EventStream(StreamingResponse):
    """An SSE response whose chunks come from an async generator, which is closed however the
    response ends: finished, or cancelled because the client went away
    (:mod:`~coordinator.api.middleware` cancels the handler; this response does not listen for
    the disconnect itself, so nothing but that one cancellation interrupts the closing)."""

    body_iterator: AsyncGenerator[bytes, None]

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(chunks, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # a server that reports the disconnect on send: the guard cancels us
            log.debug("the client went away while its stream was sent")
        finally:
            await self.body_iterator.aclose()


async def chained(first: TokenEvent, rest: Events) -> AsyncIterator[TokenEvent]:
    """A stream's events from its first one (already taken) on."""
    yield first
    async for event in rest:
        yield event


async def open_stream(
    events: Events,
    chunks: Callable[[TokenEvent, Events], AsyncGenerator[bytes, None]],
    on_error: OnError,
) -> Response:
    """An SSE response once the first event is there; a service error before it still gets its
    HTTP status (shaped by ``on_error``)."""
    events = raising_failures(events)
    try:
        first = await anext(events)
    except ServiceError as exc:
        await events.aclose()
        return on_error(APIError.from_service(exc))
    return EventStream(chunks(first, events))


async def collect(events: Events, answer: Answer) -> None:
    """Feed every event to ``answer`` until it is complete (closing the events aborts the rest of
    the generation). Service errors, and every unfinished end, propagate as ServiceError."""
    events = raising_failures(events)
    try:
        async for event in events:
            if answer.add(event):
                break
    finally:
        await events.aclose()


async def respond(events: Events, answer: Answer, stream: bool, on_error: OnError) -> Response:
    """Answer a generation streamed or whole; ``on_error`` shapes a service error that happens
    before anything was sent (a whole answer is never sent with partial text)."""
    if stream:
        return await open_stream(events, answer.stream, on_error)
    try:
        await collect(events, answer)
    except ServiceError as exc:
        return on_error(APIError.from_service(exc))
    return JSONResponse(answer.body())
