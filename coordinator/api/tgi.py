"""TGI routes: ``POST /generate``, ``POST /generate_stream`` and the compat ``POST /`` that the
``text-generation`` client calls (a one-element list, or SSE when ``stream`` is true).

Bodies are read by :mod:`~coordinator.api.tgi_request` (every parameter TGI defines honoured
or refused; ``grammar``, ``{"type": "json" | "regex", "value"}``, compiled here: 422 when it
does not compile). Errors:
``{"error": msg, "error_type": "validation" | "overloaded" | "generation"}`` (TGI's lowercase
values), 422 for invalid parameters, 400 ``content_filter`` for a prompt the content filter
blocks; an output it matches is cut before the match (:class:`TgiAnswer`). A failure before the
first byte is answered with its own status; after it, the stream ends with one
``data:{"error", "error_type"}`` event (the error type as the status would have had), never with
a finished token event; a whole answer is never sent with partial text.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api.clients import Client, client_of
from coordinator.api.common import Door, Events, chained, create_router, read_json, respond
from coordinator.api.errors import APIError, FormatError, InputValidationError, retry_headers
from coordinator.api.limits import prompt_char_limit
from coordinator.api.mindie_format import FINISH_REASONS
from coordinator.api.sse import DATA_NO_SPACE, sse_event
from coordinator.api.structured_request import check_compiles, tgi_constraint
from coordinator.api.tgi_request import parse_tgi_body
from coordinator.content_safety import INPUT_FILTERED, ContentFilter, text_blocked
from coordinator.errors import ServiceError
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.constraint import Constraint
from engine.outputs import TokenEvent
from engine.request import FinishReason

OVERLOADED = (429, 503)  # the statuses TGI calls "overloaded"; other failures are "generation"


def tgi_error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": kind}, status_code=status, headers=headers)


def service_error_kind(status: int) -> str:
    return "overloaded" if status in OVERLOADED else "generation"


def service_error_response(error: APIError) -> JSONResponse:
    kind = service_error_kind(error.status)
    return tgi_error(error.status, error.message, kind, retry_headers(error))


def stream_error(exc: ServiceError) -> bytes:
    """The event that ends a stream a failure broke."""
    error = {"error": str(exc), "error_type": service_error_kind(exc.status)}
    return sse_event(error, DATA_NO_SPACE)


@dataclass(eq=False)
class TgiAnswer:
    """Accumulates events into TGI's shapes: the answer with its ``details`` (in a one-element
    list for the compat route), or the stream's token events. An output the content filter
    matches is cut before the match and ends there as ``stop_sequence`` (the one finish TGI's
    clients know for an answer cut short on its text)."""

    seed: int
    special_ids: set[int]
    listed: bool
    content_filter: ContentFilter | None = None
    text: str = ""
    prefix: str = ""  # return_full_text: the prompt, before generated_text
    finish: FinishReason | None = None
    tokens: list[dict[str, Any]] = field(default_factory=list)
    blocked: bool = False
    token_text: Callable[[int], str] | None = None  # set with top_n_tokens: alternatives' texts
    top_tokens: list[list[dict[str, Any]]] = field(default_factory=list)

    def add(self, event: TokenEvent) -> bool:
        self.text += event.text
        if event.token_id is not None:
            special = event.token_id in self.special_ids
            logprobs = event.logprobs
            logprob = logprobs.logprob if logprobs is not None else None
            token = {"id": event.token_id, "text": event.text, "logprob": logprob,
                     "special": special}  # fmt: skip
            self.tokens.append(token)
            if self.token_text is not None:
                top = logprobs.top if logprobs is not None else ()
                self.top_tokens.append([self._alternative(i, lp) for i, lp in top])
        self.finish = event.finish_reason or self.finish
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self._cut(match.start())
        return self.blocked

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        assert self.token_text is not None
        text, special = self.token_text(token_id), token_id in self.special_ids
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def _cut(self, end: int) -> None:
        """End the answer at character ``end``: the text and the tokens' texts cut there."""
        self.text, self.finish, self.blocked = self.text[:end], FinishReason.STOP, True
        kept = 0
        for token in self.tokens:
            token["text"] = token["text"][: max(end - kept, 0)]
            kept += len(token["text"])

    def body(self) -> Any:
        details = {
            **self._stream_details(),
            "prefill": [],
            "tokens": self.tokens,
            "top_tokens": self.top_tokens if self.token_text is not None else None,
            "best_of_sequences": None,
        }
        answer = {"generated_text": self.prefix + self.text, "details": details}
        return [answer] if self.listed else answer

    def chunk(self, event: TokenEvent) -> bytes:
        """The event of the token just added; the last one carries the text and details."""
        done = event.finished or self.blocked
        payload = {
            "token": self.tokens[-1],
            "top_tokens": self.top_tokens[-1] if self.token_text is not None else None,
            "generated_text": self.prefix + self.text if done else None,
            "details": self._stream_details() if done else None,
        }
        return sse_event(payload, DATA_NO_SPACE)

    def _stream_details(self) -> dict[str, Any]:
        return {
            "finish_reason": FINISH_REASONS[self.finish or FinishReason.LENGTH],  # MindIE's names
            "generated_tokens": len(self.tokens),
            "seed": self.seed,
        }

    async def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        try:
            async for event in chained(first, events):
                self.add(event)
                if event.token_id is not None or (self.blocked and self.tokens):
                    yield self.chunk(event)
                if event.finished or self.blocked:
                    break
        except ServiceError as exc:
            yield stream_error(exc)
        finally:
            await events.aclose()


class TgiRoutes(Door):
    """The TGI handlers over one service and model."""

    @cached_property
    def special_ids(self) -> set[int]:
        return set(getattr(self.model.tokenizer, "all_special_ids", []))

    async def generate(self, request: Request) -> Response:
        return await self._generate(request, stream=False)

    async def generate_stream(self, request: Request) -> Response:
        return await self._generate(request, stream=True)

    async def compat(self, request: Request) -> Response:
        return await self._generate(request, stream=None)

    async def _generate(self, request: Request, stream: bool | None) -> Response:
        """``stream=None``: the compat route, which streams when the body asks to."""
        try:
            body = await read_json(request, self.body_limit_mb)
            tgi = parse_tgi_body(body, prompt_char_limit(self.model.max_input_tokens))
            req = tgi.request
            constraint = await self._constraint(body, client_of(request))
            ids = await self._prompt_ids(req.text)
        except APIError as exc:
            if exc.status == 429:  # a client's own limit (compiles a minute)
                return service_error_response(exc)
            return tgi_error(exc.status, exc.message, "validation")
        if text_blocked(self.model.content_filter, req.text):
            return tgi_error(400, INPUT_FILTERED, "content_filter")
        if tgi.truncate is not None:
            ids = ids[-tgi.truncate :]
        p = req.parameters
        params = replace(
            p.sampling_params(self.model.vocab_size, tgi.stop),
            constraint=constraint,
            frequency_penalty=tgi.frequency_penalty,
            logprobs=tgi.top_n_tokens,  # each token's logprob always, as TGI reports it
        )
        events = self.generation(request, ids, params, priority=p.priority, timeout_s=p.timeout)
        answer = TgiAnswer(params.seed, self.special_ids, stream is None, self.model.content_filter)
        answer.prefix = req.text if tgi.return_full_text else ""
        if tgi.top_n_tokens:
            answer.token_text = self.model.token_text
        streaming = body.get("stream", False) if stream is None else stream
        return await respond(events, answer, streaming, service_error_response)

    async def _constraint(self, body: dict, client: Client) -> Constraint | None:
        """``parameters.grammar``'s constraint, compiled once here, a new one charged to
        ``client`` (422 when it does not compile)."""
        try:
            constraint = tgi_constraint((body.get("parameters") or {}).get("grammar"))
            await check_compiles(self.model, constraint, "grammar", client)
        except FormatError as exc:
            raise InputValidationError(exc.message) from exc
        return constraint

    async def _prompt_ids(self, text: str) -> list[int]:
        ids = await run_in_threadpool(self.model.tokenizer.encode, text)
        limit = self.model.max_input_tokens
        if not 0 < len(ids) <= limit:
            raise InputValidationError(f"inputs must have [1, {limit}] tokens, got {len(ids)}")
        return ids


def create_tgi_router(service: InferenceService, model: ModelInfo, body_limit_mb: int) -> APIRouter:
    routes = TgiRoutes(service, model, body_limit_mb)
    return create_router(
        ("POST", "/generate", routes.generate),
        ("POST", "/generate_stream", routes.generate_stream),
        ("POST", "/", routes.compat),  # the text-generation client's route
    )
