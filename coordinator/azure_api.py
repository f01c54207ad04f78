"""Azure AI Model Inference routes (SPEC §4), mounted at ``/`` and at ``/models``:
``GET /info``, ``POST /chat/completions``, ``POST /images/embeddings``.

Every call needs a known ``api-version``. The ``extra-parameters`` header decides what happens
to body keys outside the API: ``error`` (default) → 400, ``drop`` → ignored, ``pass-through`` →
handed to the engine when pdserve understands them (else 422). Known parameters this model
cannot honour answer 422 ``parameter_not_supported``. Streams are exactly ``data: {json}\\n\\n``
chunks and ``data: [DONE]\\n\\n`` (no comments, no ``event:`` lines: the SDK rejects them).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.infer_api import APIError, ModelInfo, read_json
from coordinator.inference import InferenceService
from coordinator.openai_api import (
    STATUS,
    OpenAIError,
    _Completion,
    _prompt_ids,
    input_blocked,
    openai_sampling,
    respond,
)
from engine.worker_contracts import GenerationRequest

API_VERSIONS = ("2024-04-01-preview", "2024-05-01-preview", "2025-04-01", "2025-05-01")
CHAT_KEYS = {
    "messages",
    "temperature",
    "top_p",
    "max_tokens",
    "stop",
    "seed",
    "stream",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "model",
    "stream_options",
}
PASS_THROUGH = {"top_k", "repetition_penalty", "typical_p", "do_sample", "ignore_eos", "min_tokens"}
EXTRA_MODES = ("error", "drop", "pass-through")


class AzureError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict | None = None) -> None:
        super().__init__(json.dumps(body))
        self.status, self.body, self.headers = status, body, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def _error(status: int, code: str, message: str) -> AzureError:
    return AzureError(status, {"error": {"code": code, "message": message}})


def not_supported(param: str, value: Any) -> AzureError:
    return AzureError(
        422,
        {
            "status": 422,
            "code": "parameter_not_supported",
            "detail": {"loc": ["body", param], "input": value},
            "message": "One of the parameters contain invalid values.",
        },
        {"x-ms-error-code": "parameter_not_supported"},
    )


def _service_error(exc: Exception) -> Response:
    return _error(STATUS[type(exc)], type(exc).__name__, str(exc)).response()


def check_api_version(request: Request) -> None:
    version = request.query_params.get("api-version")
    if version not in API_VERSIONS:
        raise _error(
            400,
            "BadRequest",
            f"api-version {version!r} is not supported; use one of {', '.join(API_VERSIONS)}",
        )


def split_extras(
    request: Request,
    body: dict,
    known: frozenset[str] | set[str] = CHAT_KEYS,
    pass_through: frozenset[str] | set[str] = PASS_THROUGH,
) -> dict[str, Any]:
    """The body's keys outside the API's ``known`` ones, after the ``extra-parameters`` policy;
    with ``pass-through`` only keys the model understands (``pass_through``) are let in."""
    mode = request.headers.get("extra-parameters", "error")
    if mode not in EXTRA_MODES:
        raise _error(
            400,
            "BadRequest",
            f"extra-parameters must be one of {', '.join(EXTRA_MODES)}; got {mode!r}",
        )
    extras = {k: v for k, v in body.items() if k not in known}
    if extras and mode == "error":
        raise _error(
            400,
            "BadRequest",
            f"Extra parameters {sorted(extras)} are not allowed when "
            "extra-parameters is not set or set to be 'error'. Set extra-parameters to "
            "'pass-through' to pass to the model.",
        )
    if mode != "pass-through":
        return {}
    for key, value in extras.items():
        if key not in pass_through:
            raise not_supported(key, value)
    return extras


def check_supported(body: dict) -> None:
    """Known parameters a text-only model without tool use cannot honour."""
    if body.get("tools"):
        raise not_supported("tools", body["tools"])
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise not_supported("tool_choice", body["tool_choice"])
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise not_supported("response_format", response_format)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise not_supported(name, body[name])


def create_info_router(name: str, model_type: str) -> APIRouter:
    """``GET /info`` (also under ``/models``): the model's name, type and provider."""
    router = APIRouter()

    async def info(request: Request) -> Response:
        try:
            check_api_version(request)
        except AzureError as exc:
            return exc.response()
        return JSONResponse(
            {"model_name": name, "model_type": model_type, "model_provider_name": "pdserve"}
        )

    for prefix in ("", "/models"):
        router.add_api_route(f"{prefix}/info", info, methods=["GET"])
    return router


def create_azure_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    router = create_info_router(model.name, "chat-completion")

    async def images_embeddings(request: Request) -> Response:
        return _error(404, "NotFound", "Modality not supported by the model").response()

    async def chat(request: Request) -> Response:
        try:
            check_api_version(request)
            body = await read_json(request, body_limit_mb)
            if not isinstance(body, dict):
                raise _error(400, "BadRequest", "the request body must be a JSON object")
            extras = split_extras(request, body)
            check_supported(body)
            ids = await _prompt_ids(body, "chat", model)
            if input_blocked(model, body, "chat"):
                raise AzureError(
                    400,
                    {
                        "status": 400,
                        "code": "content_filter",
                        "message": "The response was filtered",
                        "param": "messages",
                        "type": None,
                    },
                )
            known = {k: v for k, v in body.items() if k in CHAT_KEYS}
            params = openai_sampling({**known, **extras}, model.vocab_size, 512)
        except AzureError as exc:
            return exc.response()
        except APIError as exc:
            return _error(exc.status, "BadRequest", exc.message).response()
        except OpenAIError as exc:
            return AzureError(
                exc.status, {"error": {"code": "BadRequest", "message": exc.message}}
            ).response()
        answer = _Completion("chat", model.name, len(ids), model.content_filter)
        events = service.generate(GenerationRequest(service.new_request_id(), ids, params))
        return await respond(events, answer, bool(body.get("stream")), _service_error)

    for prefix in ("", "/models"):
        router.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        router.add_api_route(f"{prefix}/images/embeddings", images_embeddings, methods=["POST"])
    return router
