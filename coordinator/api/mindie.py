"""MindIE's native routes on the predict port: ``/infer``, ``/infer_token``, ``/v1/tokenizer``.

A request's life: the body is read (413 past ``body_limit``) and validated
(:mod:`~coordinator.api.mindie_request`: 400 for a wrong shape, 422 naming the parameter), its
media checked, its text tokenized and checked by the content filter (400 ``content_filter``); the
service generates, and the answer is streamed as SSE events or collected whole
(:mod:`~coordinator.api.mindie_format`; the content filter cuts an output that matches). A
failure before the first byte is answered with its own HTTP status, after it with a final error
event (``finish_reason: "stop_sequence"`` and the error); a whole answer is never sent with partial
text. A client that goes away aborts the request, streamed or not (the app's disconnect guard
cancels the handler).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api.common import Door, create_router, read_json, respond
from coordinator.api.errors import APIError, InputValidationError, retry_headers
from coordinator.api.limits import MAX_INPUT_TOKENS, prompt_char_limit
from coordinator.api.media import check_media
from coordinator.api.mindie_format import (
    CONTENT_FILTER,
    InferAnswer,
    error_body,
    service_error,
)
from coordinator.api.mindie_request import (
    InferRequest,
    parse_infer_body,
    parse_tokenizer_body,
)
from coordinator.content_safety import INPUT_FILTERED, text_blocked
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo


def error_response(error: APIError) -> JSONResponse:
    """MindIE's error body ``{"error", "error_type"}`` with the error's status."""
    return JSONResponse(error_body(error), status_code=error.status, headers=retry_headers(error))


def service_error_response(error: APIError) -> JSONResponse:
    return error_response(service_error(error))


class MindieRoutes(Door):
    """The MindIE handlers over one service and model."""

    async def infer(self, request: Request) -> Response:
        return await self._infer(request, token_input=False)

    async def infer_token(self, request: Request) -> Response:
        return await self._infer(request, token_input=True)

    async def tokenizer(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.body_limit_mb)
            text = parse_tokenizer_body(body, prompt_char_limit(self.model.max_input_tokens))
            ids = await run_in_threadpool(self.model.tokenizer.encode, text)
            self._check_token_count(ids)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse({"token_number": len(ids), "tokens": ids})

    async def _infer(self, request: Request, token_input: bool) -> Response:
        try:
            body = await read_json(request, self.body_limit_mb)
            max_chars = prompt_char_limit(self.model.max_input_tokens)
            req = parse_infer_body(body, input_id=token_input, max_chars=max_chars)
            ids = await self._prompt_ids(req)
            await self._check_content(req, ids)
        except APIError as exc:
            return error_response(exc)
        p = req.parameters
        params = p.sampling_params(self.model.vocab_size)
        answer = InferAnswer(
            params.seed,
            p.details,
            self.model.full_text_enabled,
            time.monotonic(),
            content_filter=self.model.content_filter,
        )
        events = self.generation(request, ids, params, priority=p.priority, timeout_s=p.timeout)
        return await respond(events, answer, req.stream, service_error_response)

    async def _prompt_ids(self, req: InferRequest) -> list[int]:
        self._check_media(req)
        ids: list[int]
        if req.token_ids is None:
            ids = await run_in_threadpool(self.model.tokenizer.encode, req.text)
        else:
            ids = req.token_ids
        if req.token_ids is not None and max(ids) >= self.model.vocab_size:
            raise InputValidationError(
                f"Parameter input_id must hold token ids in [0, {self.model.vocab_size}), but "
                f"got {max(ids)}"
            )
        self._check_token_count(ids)
        return ids

    def _check_token_count(self, ids: list[int]) -> None:
        limit = min(self.model.max_input_tokens, MAX_INPUT_TOKENS)
        if not 0 < len(ids) <= limit:
            raise InputValidationError(
                f"Parameter inputs must be [1, {limit}] tokens after tokenization, but got "
                f"{len(ids)} tokens"
            )

    async def _check_content(self, req: InferRequest, ids: list[int]) -> None:
        """400 ``content_filter`` when the content filter blocks the prompt (``/infer_token``:
        its decoded text)."""
        content_filter = self.model.content_filter
        if content_filter is None:
            return
        text = req.text
        if req.token_ids is not None:
            text = await run_in_threadpool(self.model.tokenizer.decode, ids)
        if text_blocked(content_filter, text):
            raise APIError(400, INPUT_FILTERED, CONTENT_FILTER)

    def _check_media(self, req: InferRequest) -> None:
        if not req.media:
            return
        check_media(req.media, self.model.allowed_media_dirs)
        kinds = sorted({item["type"] for item in req.media} - set(self.model.modalities))
        if kinds:
            raise InputValidationError(
                f"Parameter inputs holds {', '.join(kinds)} items, but model {self.model.name} "
                "supports text input only"
            )


def create_infer_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    routes = MindieRoutes(service, model, body_limit_mb)
    return create_router(
        ("POST", "/infer", routes.infer),
        ("POST", "/infer_token", routes.infer_token),
        ("POST", "/v1/tokenizer", routes.tokenizer),
    )
