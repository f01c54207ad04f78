"""MindIE's native routes on the predict port: ``/infer``, ``/infer_token``, ``/v1/tokenizer``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from coordinator.errors import NoWorkerError, RequestTimeout, ServiceError, TooManyRequests
from coordinator.infer_format import InferAnswer, error_body, sse
from coordinator.infer_request import (
    MAX_TOKENS_HARD,
    BadRequestError,
    InferRequest,
    InputValidationError,
    parse_infer_body,
)
from coordinator.inference import InferenceService, first_event
from coordinator.media import check_media
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.worker_contracts import GenerationRequest


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
    """An error answered with MindIE's JSON body."""

    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.error_type), status_code=self.status)


def _service_error(exc: Exception) -> APIError:
    if isinstance(exc, TooManyRequests):
        return APIError(429, "Too many requests", "Too many requests")
    if isinstance(exc, RequestTimeout):
        return APIError(408, str(exc), "Request Timeout")
    if isinstance(exc, NoWorkerError):
        return APIError(503, f"Service Unavailable: {exc}", "Service Unavailable")
    return APIError(500, f"Incomplete Generation: {exc}", "Incomplete Generation")


async def read_json(request: Request, body_limit_mb: int) -> Any:
    body = await request.body()
    if len(body) > body_limit_mb * 1024 * 1024:
        raise APIError(
            413,
            f"request body of {len(body)} bytes is over the limit of {body_limit_mb} MB",
            "Payload Too Large",
        )
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON: {exc}", "Bad Request") from exc


def sampling_params(req: InferRequest, vocab_size: int) -> SamplingParams:
    p = req.parameters
    return SamplingParams(
        max_new_tokens=p.max_new_tokens,
        do_sample=p.sampling,
        temperature=p.temperature or 1.0,
        top_k=min(p.top_k or 0, vocab_size),
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty,
        seed=p.seed if p.seed is not None else secrets.randbelow(MAX_SEED) + 1,
        ignore_eos=p.ignore_eos,
    )


def create_infer_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    router = APIRouter()

    async def prompt_ids(req: InferRequest) -> list[int]:
        if req.media:
            check_media(req.media, model.allowed_media_dirs)
            kinds = sorted({item["type"] for item in req.media} - set(model.modalities))
            if kinds:
                raise InputValidationError(
                    f"Parameter inputs holds {', '.join(kinds)} items, but model {model.name} "
                    "supports text input only"
                )
        ids = req.token_ids
        if ids is None:
            ids = await run_in_threadpool(model.tokenizer.encode, req.text)
        elif max(ids) >= model.vocab_size:
            raise InputValidationError(
                f"Parameter input_id must hold token ids in [0, {model.vocab_size}), but got "
                f"{max(ids)}"
            )
        limit = min(model.max_input_tokens, MAX_TOKENS_HARD)
        if not 0 < len(ids) <= limit:
            raise InputValidationError(
                f"Parameter inputs must be [1, {limit}] tokens after tokenization, but got "
                f"{len(ids)} tokens"
            )
        return ids

    async def infer(request: Request, token_input: bool) -> Response:
        try:
            body = await read_json(request, body_limit_mb)
            req = parse_infer_body(body, input_id=token_input)
            ids = await prompt_ids(req)
        except APIError as exc:
            return exc.response()
        except BadRequestError as exc:
            return APIError(400, str(exc), "Bad Request").response()
        except InputValidationError as exc:
            return APIError(422, str(exc), "Input Validation Error").response()
        params = sampling_params(req, model.vocab_size)
        answer = InferAnswer(
            params.seed, req.parameters.details, model.full_text_enabled, time.monotonic()
        )
        events = service.generate(
            GenerationRequest(
                service.new_request_id(),
                ids,
                params,
                req.parameters.priority,
                req.parameters.timeout,
            )
        )
        if req.stream:
            try:  # errors before the first token still get their HTTP status
                first = await first_event(events)
            except ServiceError as exc:
                return _service_error(exc).response()
            return StreamingResponse(_stream(first, events, answer), media_type="text/event-stream")
        return await _text(request, events, answer)

    @router.post("/infer")
    async def infer_text(request: Request) -> Response:
        return await infer(request, token_input=False)

    @router.post("/infer_token")
    async def infer_token(request: Request) -> Response:
        return await infer(request, token_input=True)

    @router.post("/v1/tokenizer")
    async def tokenizer(request: Request) -> Response:
        try:
            body = await read_json(request, body_limit_mb)
        except APIError as exc:
            return exc.response()
        inputs = body.get("inputs") if isinstance(body, dict) else None
        if not isinstance(inputs, str) or not inputs:
            return APIError(
                422,
                f"Parameter inputs must be a non-empty string, but got {json.dumps(inputs)[:200]}",
                "Input Validation Error",
            ).response()
        ids = await run_in_threadpool(model.tokenizer.encode, inputs)
        return JSONResponse({"token_number": len(ids), "tokens": ids})

    return router


async def _chain(first: Any, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _stream(first: Any, events: AsyncIterator, answer: InferAnswer) -> AsyncIterator[bytes]:
    """SSE events; an error after the headers went out becomes a final error event."""
    try:
        async for event in _chain(first, events):
            payload = answer.add(event, time.monotonic())
            if payload is not None:
                yield sse(payload)
    except ServiceError as exc:
        error = _service_error(exc)
        yield sse(error_body(error.message, error.error_type))
    finally:
        await events.aclose()


async def _text(request: Request, events: AsyncIterator, answer: InferAnswer) -> Response:
    """Collect the answer; a client that disconnects meanwhile aborts the request."""

    async def collect() -> None:
        async for event in events:
            answer.add(event, time.monotonic())

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        task.result()
    except ServiceError as exc:
        return _service_error(exc).response()
    finally:
        await events.aclose()
    return JSONResponse(answer.text_body())
