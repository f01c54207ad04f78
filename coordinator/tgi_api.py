"""TGI routes: ``POST /generate``, ``POST /generate_stream`` and the compat ``POST /`` that the
``text-generation`` client calls (a one-element list, or SSE when ``stream`` is true).

Errors: ``{"error": msg, "error_type": "validation" | "overloaded" | "generation"}`` (TGI's
lowercase values), 422 for invalid parameters.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from coordinator.errors import NoWorkerError, RequestTimeout, ServiceError, TooManyRequests
from coordinator.infer_api import APIError, ModelInfo, read_json, sampling_params
from coordinator.infer_request import InputValidationError, parse_infer_body
from coordinator.inference import InferenceService, first_event
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.worker_contracts import GenerationRequest

FINISH = {
    FinishReason.EOS: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop_sequence",
    FinishReason.ABORT: "stop_sequence",
    FinishReason.ERROR: "stop_sequence",
}


def tgi_error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": message, "error_type": kind}, status_code=status)


def _service_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, TooManyRequests | NoWorkerError):
        return tgi_error(429 if isinstance(exc, TooManyRequests) else 503, str(exc), "overloaded")
    return tgi_error(408 if isinstance(exc, RequestTimeout) else 500, str(exc), "generation")


def _token(event: TokenEvent, special: bool) -> dict[str, Any]:
    return {"id": event.token_id, "text": event.text, "logprob": None, "special": special}


def create_tgi_router(service: InferenceService, model: ModelInfo, body_limit_mb: int) -> APIRouter:
    router = APIRouter()
    special_ids = set(getattr(model.tokenizer, "all_special_ids", []))

    async def generate(request: Request, stream: bool | None) -> Response:
        try:
            body = await read_json(request, body_limit_mb)
            if not isinstance(body, dict) or not isinstance(body.get("inputs"), str):
                raise InputValidationError("inputs must be a non-empty string")
            raw = dict(body.get("parameters") or {})
            stop = raw.pop("stop", None) or []
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise InputValidationError("stop must be a list of non-empty strings")
            known = {
                k: v
                for k, v in raw.items()
                if k
                in (
                    "temperature",
                    "top_k",
                    "top_p",
                    "max_new_tokens",
                    "do_sample",
                    "seed",
                    "repetition_penalty",
                    "typical_p",
                    "details",
                    "watermark",
                )
            }
            req = parse_infer_body({"inputs": body["inputs"], "parameters": known})
            ids = await run_in_threadpool(model.tokenizer.encode, req.text)
            if not 0 < len(ids) <= model.max_input_tokens:
                raise InputValidationError(
                    f"inputs must have [1, {model.max_input_tokens}] tokens, got {len(ids)}"
                )
        except APIError as exc:
            return tgi_error(exc.status, exc.message, "validation")
        except InputValidationError as exc:
            return tgi_error(422, str(exc), "validation")
        params = sampling_params(req, model.vocab_size)
        params = type(params)(**{**params.to_dict(), "stop": tuple(stop)})
        events = service.generate(
            GenerationRequest(
                service.new_request_id(),
                ids,
                params,
                req.parameters.priority,
                req.parameters.timeout,
            )
        )
        streaming = body.get("stream", False) if stream is None else stream
        if streaming:
            try:
                first = await first_event(events)
            except ServiceError as exc:
                return _service_error(exc)
            return StreamingResponse(
                _stream(first, events, params.seed, special_ids), media_type="text/event-stream"
            )
        tokens, text, finish = [], "", None
        try:
            async for event in events:
                text += event.text
                if event.token_id is not None:
                    tokens.append(_token(event, event.token_id in special_ids))
                finish = event.finish_reason or finish
        except ServiceError as exc:
            return _service_error(exc)
        finally:
            await events.aclose()
        answer = {
            "generated_text": text,
            "details": {
                "finish_reason": FINISH[finish or FinishReason.LENGTH],
                "generated_tokens": len(tokens),
                "seed": params.seed,
                "prefill": [],
                "tokens": tokens,
                "top_tokens": None,
                "best_of_sequences": None,
            },
        }
        return JSONResponse([answer] if stream is None else answer)

    @router.post("/generate")
    async def generate_route(request: Request) -> Response:
        return await generate(request, stream=False)

    @router.post("/generate_stream")
    async def generate_stream_route(request: Request) -> Response:
        return await generate(request, stream=True)

    @router.post("/")
    async def compat(request: Request) -> Response:
        return await generate(request, stream=None)

    return router


async def _stream(
    first: TokenEvent, events: AsyncIterator, seed: int, special_ids: set[int]
) -> AsyncIterator[bytes]:
    text, count = "", 0
    try:
        event: TokenEvent | None = first
        while event is not None:
            text += event.text
            if event.token_id is not None:
                count += 1
                done = event.finished
                payload = {
                    "token": _token(event, event.token_id in special_ids),
                    "top_tokens": None,
                    "generated_text": text if done else None,
                    "details": {
                        "finish_reason": FINISH[event.finish_reason],
                        "generated_tokens": count,
                        "seed": seed,
                    }
                    if done
                    else None,
                }
                yield b"data:" + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
            if event.finished:
                break
            event = await events.__anext__()
    except ServiceError as exc:
        yield (
            b"data:"
            + json.dumps({"error": str(exc), "error_type": "generation"}).encode()
            + b"\n\n"
        )
    finally:
        await events.aclose()
