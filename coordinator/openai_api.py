"""OpenAI-style routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Streams are ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``; the last content
chunk carries ``finish_reason`` and ``usage``. ``stop`` (a string or a list) ends generation on an
exact match in the decoded text and is cut from the answer. Errors use OpenAI's body:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from coordinator.content_safety import ContentFilter
from coordinator.errors import (
    GenerationFailed,
    NoWorkerError,
    RequestTimeout,
    ServiceError,
    TooManyRequests,
)
from coordinator.infer_api import APIError, ModelInfo, read_json
from coordinator.inference import InferenceService, first_event
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.worker_contracts import GenerationRequest

FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "stop",
    FinishReason.ERROR: "stop",
}
STATUS = {TooManyRequests: 429, RequestTimeout: 408, NoWorkerError: 503, GenerationFailed: 500}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            },
            status_code=self.status,
        )


def _number(body: dict, name: str, low: float, high: float, integer: bool, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int if integer else int | float) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise OpenAIError(
            400, f"'{name}' must be {kind} in [{low:g}, {high:g}], got {json.dumps(value)}", name
        )
    return value


def openai_sampling(body: dict, vocab_size: int, default_max_tokens: int) -> SamplingParams:
    """The OpenAI parameters pdserve honours, validated."""
    if body.get("n") not in (None, 1):
        raise OpenAIError(400, f"'n' must be 1, got {json.dumps(body['n'])}", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise OpenAIError(
            400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    temperature = _number(body, "temperature", 0, 2, False, 1.0)
    top_p = _number(body, "top_p", 0, 1, False, 1.0)
    seed = _number(body, "seed", 0, MAX_SEED, True, None)
    return SamplingParams(
        max_new_tokens=_number(
            {"max_tokens": max_tokens}, "max_tokens", 1, 2**31 - 1, True, default_max_tokens
        ),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_p=top_p if top_p > 0 else 1e-9,
        top_k=min(_number(body, "top_k", 0, 2**31 - 1, True, 0), vocab_size),
        repetition_penalty=_number(body, "repetition_penalty", 1e-6, 100, False, 1.0),
        seed=seed if seed is not None else secrets.randbelow(MAX_SEED) + 1,
        stop=tuple(stop or ()),
        ignore_eos=_flag(body, "ignore_eos"),
    )


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise OpenAIError(400, f"'{name}' must be true or false, got {json.dumps(value)}", name)
    return value


class _Completion:
    """Accumulates events into OpenAI's shapes, for chat or text completions."""

    def __init__(
        self,
        kind: str,
        model: str,
        num_prompt_tokens: int,
        content_filter: ContentFilter | None = None,
    ) -> None:
        self.kind, self.model, self.num_prompt_tokens = kind, model, num_prompt_tokens
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text, self.num_tokens, self.finish = "", 0, None
        self.content_filter = content_filter
        self.blocked = False
        self.sent = 0  # characters already streamed

    def add(self, event: TokenEvent) -> None:
        """Take an event; a filtered output is cut before the match and ``blocked``."""
        self.text += event.text
        self.num_tokens += event.token_id is not None
        if event.finish_reason is not None:
            self.finish = FINISH[event.finish_reason]
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self.text, self.finish, self.blocked = (
                self.text[: match.start()],
                "content_filter",
                True,
            )

    def pending(self) -> str:
        """Text not streamed yet (taken)."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_tokens,
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        if chunk and self.kind == "chat":
            obj += ".chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text, "tool_calls": None},
                "finish_reason": self.finish,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.finish, "logprobs": None}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage}

    def chunk(
        self, piece: str | None, finish: str | None, role: bool = False, usage: bool = False
    ) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if piece is not None:
                delta["content"] = piece
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        payload = {**self._envelope(True), "choices": [choice]}
        if usage:
            payload["usage"] = self.usage
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def create_models_router(name: str) -> APIRouter:
    """``GET /v1/models``: the one served model."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdserve"}],
            }
        )

    return router


def create_openai_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    router = create_models_router(model.name)

    async def complete(request: Request, kind: str) -> Response:
        try:
            body = await read_json(request, body_limit_mb)
            if not isinstance(body, dict):
                raise OpenAIError(400, "the request body must be a JSON object")
            ids = await _prompt_ids(body, kind, model)
            if input_blocked(model, body, kind):
                raise OpenAIError(
                    400,
                    "The response was filtered",
                    "messages" if kind == "chat" else "prompt",
                    code="content_filter",
                )
            params = openai_sampling(body, model.vocab_size, 16 if kind == "text" else 512)
        except APIError as exc:
            return OpenAIError(exc.status, exc.message).response()
        except OpenAIError as exc:
            return exc.response()
        answer = _Completion(kind, model.name, len(ids), model.content_filter)
        events = service.generate(GenerationRequest(service.new_request_id(), ids, params))
        return await respond(events, answer, bool(body.get("stream")), _server_error)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, "text")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, "chat")

    return router


def _server_error(exc: Exception) -> Response:
    return OpenAIError(STATUS[type(exc)], str(exc), kind="server_error").response()


async def respond(
    events: AsyncIterator[TokenEvent],
    answer: _Completion,
    stream: bool,
    on_error: Callable[[Exception], Response],
) -> Response:
    """Answer a chat or text completion, streamed or whole (OpenAI and Azure shapes alike);
    ``on_error`` shapes a service error that happens before anything was sent."""
    if stream:
        try:
            first = await first_event(events)
        except ServiceError as exc:
            return on_error(exc)
        return StreamingResponse(_stream(first, events, answer), media_type="text/event-stream")
    try:
        await collect(events, answer)
    except ServiceError as exc:
        return on_error(exc)
    return JSONResponse(answer.body())


async def collect(events: AsyncIterator[TokenEvent], answer: _Completion) -> None:
    """Feed every event to ``answer``; a content-filtered output stops (and so aborts) the
    generation. Service errors propagate."""
    try:
        async for event in events:
            answer.add(event)
            if answer.blocked:
                break  # closing the events aborts the generation
    finally:
        await events.aclose()


async def _prompt_ids(body: dict, kind: str, model: ModelInfo) -> list[int]:
    if kind == "chat":
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise OpenAIError(
                400, "'messages' must be a non-empty list of {role, content}", "messages"
            )
        rendered = [
            {"role": m["role"], "content": _content_text(m.get("content"))} for m in messages
        ]
        ids = await run_in_threadpool(
            model.tokenizer.apply_chat_template, rendered, add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise OpenAIError(400, "'prompt' must be a non-empty string", "prompt")
        ids = await run_in_threadpool(model.tokenizer.encode, prompt)
    if not 0 < len(ids) <= model.max_input_tokens:
        raise OpenAIError(
            400,
            f"the prompt has {len(ids)} tokens; this model takes at most {model.max_input_tokens}",
            "messages" if kind == "chat" else "prompt",
        )
    return ids


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


async def _stream(
    first: TokenEvent, events: AsyncIterator, answer: _Completion
) -> AsyncIterator[bytes]:
    try:
        if answer.kind == "chat":
            yield answer.chunk(None, None, role=True)
        event: TokenEvent | None = first
        while event is not None:
            answer.add(event)
            piece = answer.pending()
            if piece:
                yield answer.chunk(piece, None)
            if event.finished or answer.blocked:
                yield answer.chunk(None if answer.kind == "chat" else "", answer.finish, usage=True)
                break
            event = await events.__anext__()
        yield b"data: [DONE]\n\n"
    except ServiceError as exc:
        payload = {
            "error": {
                "message": str(exc),
                "type": "server_error",
                "param": None,
                "code": STATUS[type(exc)],
            }
        }
        yield b"data: " + json.dumps(payload).encode() + b"\n\n"
    finally:
        await events.aclose()


def input_blocked(model: ModelInfo, body: dict, kind: str) -> bool:
    """Whether the content filter blocks the request's text (messages or prompt)."""
    if model.content_filter is None:
        return False
    if kind == "chat":
        text = "\n".join(_content_text(m.get("content")) for m in body.get("messages", []))
    else:
        prompt = body.get("prompt")
        text = "\n".join(prompt) if isinstance(prompt, list) else str(prompt)
    return model.content_filter.search(text) is not None
