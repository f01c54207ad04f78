"""Azure AI Model Inference routes, mounted at ``/`` and at ``/models``: ``GET /info``,
``POST /chat/completions``, ``POST /images/embeddings`` (``/embeddings`` is in
:mod:`~coordinator.api.embeddings`).

Every call needs a known ``api-version``. The ``extra-parameters`` header decides what happens
to body keys outside the API: ``error`` (default) → 400, ``drop`` → ignored, ``pass-through`` →
handed to the engine when pdserve understands them (else 422). Known parameters this model
cannot honour answer 422 ``parameter_not_supported``; ``response_format`` (``text``,
``json_object``, ``json_schema``: :mod:`~coordinator.api.structured_request`) is honoured, an
unknown ``type`` is 422, a malformed or uncompilable one 400 naming the field; a refused
``tools``, ``tool_choice`` or ``parallel_tool_calls`` is 400 naming it the same way (``loc:
["body", <field>]``). Chat requests are read and answered as OpenAI's
(:mod:`~coordinator.api.openai_request`, :mod:`~coordinator.api.openai_format`, with tools
:mod:`~coordinator.api.tools.use`), usage with ``prompt_tokens_details.cached_tokens``; streams
are exactly ``data: {json}\\n\\n`` chunks and ``data: [DONE]\\n\\n`` (no comments, no
``event:`` lines: the SDK rejects them). Errors are ``{"error": {"code", "message"}}`` unless
the API defines another body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.clients import UNLIMITED, Client, client_of
from coordinator.api.common import Door, create_router, read_object, respond
from coordinator.api.errors import APIError, AzureError, FormatError, retry_headers
from coordinator.api.openai_request import input_blocked, openai_sampling, read_prompt
from coordinator.api.structured_request import (
    check_compiles,
    constraint_param,
    response_format_constraint,
)
from coordinator.api.tools.request import ToolError, read_tools
from coordinator.api.tools.use import tool_completion, with_tool_constraint
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.constraint import Constraint

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
    "parallel_tool_calls",
    "model",
    "stream_options",
}
PASS_THROUGH = {
    "top_k",
    "repetition_penalty",
    "typical_p",
    "do_sample",
    "ignore_eos",
    "speculative",
    "min_tokens",
}
EXTRA_MODES = ("error", "drop", "pass-through")
PREFIXES = ("", "/models")
ECHOED_CHARS = 64  # how much of an unsupported value a 422 echoes


def _error(status: int, code: str, message: str) -> AzureError:
    return AzureError(status, {"error": {"code": code, "message": message}})


def _bad_request(message: str) -> AzureError:
    return _error(400, "BadRequest", message)


def error_response(error: APIError) -> JSONResponse:
    """Azure's body for any error: its own, or ``{"error": {"code", "message"}}`` where the code
    is the error's name (``BadRequest`` when it has none)."""
    headers = retry_headers(error)
    if not isinstance(error, AzureError):
        error = _error(error.status, error.code or "BadRequest", error.message)
    headers.update(error.headers)
    return JSONResponse(error.body, status_code=error.status, headers=headers)


def _echoed(value: Any) -> Any:
    """``value`` as an error echoes it (``NaN`` and ``Infinity``, which JSON lacks, as strings);
    a value whose JSON is longer than :data:`ECHOED_CHARS` as that JSON text, cut there."""
    text = json.dumps(value)
    if len(text) > ECHOED_CHARS:
        return text[:ECHOED_CHARS] + "..."
    return json.loads(text, parse_constant=str)


def not_supported(param: str, value: Any) -> AzureError:
    """422 naming the parameter and echoing its value."""
    return AzureError(
        422,
        {
            "status": 422,
            "code": "parameter_not_supported",
            "detail": {"loc": ["body", param], "input": _echoed(value)},
            "message": "One of the parameters contain invalid values.",
        },
        {"x-ms-error-code": "parameter_not_supported"},
    )


def content_filtered() -> AzureError:
    body = {
        "status": 400,
        "code": "content_filter",
        "message": "The response was filtered",
        "param": "messages",
        "type": None,
    }
    return AzureError(400, body)


def check_api_version(request: Request) -> None:
    version = request.query_params.get("api-version")
    if version not in API_VERSIONS:
        raise _bad_request(
            f"api-version {version!r} is not supported; use one of {', '.join(API_VERSIONS)}"
        )


def split_extras(
    request: Request,
    body: dict,
    known: frozenset[str] | set[str] = CHAT_KEYS,
    pass_through: frozenset[str] | set[str] = PASS_THROUGH,
) -> dict[str, Any]:
    """The body's keys outside the API's ``known`` ones, after the ``extra-parameters`` policy;
    with ``pass-through`` only keys the model understands (``pass_through``) are let in."""
    mode = _extra_mode(request)
    extras = {k: v for k, v in body.items() if k not in known}
    if extras and mode == "error":
        raise _bad_request(
            f"Extra parameters {sorted(extras)} are not allowed when "
            "extra-parameters is not set or set to be 'error'. Set extra-parameters to "
            "'pass-through' to pass to the model."
        )
    if mode != "pass-through":
        return {}
    for key, value in extras.items():
        if key not in pass_through:
            raise not_supported(key, value)
    return extras


def _extra_mode(request: Request) -> str:
    mode = request.headers.get("extra-parameters", "error")
    if mode not in EXTRA_MODES:
        raise _bad_request(
            f"extra-parameters must be one of {', '.join(EXTRA_MODES)}; got {mode!r}"
        )
    return mode


async def azure_constraint(
    body: dict, model: ModelInfo, client: Client = UNLIMITED
) -> Constraint | None:
    """``response_format``'s constraint, compiled once here, a new one charged to ``client`` (a
    ``type`` this server does not know: 422 ``parameter_not_supported``; a malformed or
    uncompilable one: 400 naming it)."""
    try:
        constraint = response_format_constraint(body.get("response_format"))
        await check_compiles(model, constraint, constraint_param(body), client)
    except FormatError as exc:
        if exc.unsupported:
            raise not_supported("response_format", body["response_format"]) from exc
        raise invalid_parameter(exc.param, exc.message, exc.value) from exc
    return constraint


def invalid_parameter(param: str, message: str, value: Any = None) -> AzureError:
    """400 naming the parameter, in the shape of the 422's with ``error`` beside it (what the
    SDK reads): ``loc`` the body's field path."""
    body = {
        "status": 400,
        "code": "invalid_parameter",
        "detail": {"loc": ["body", *param.split(".")], "input": _echoed(value)},
        "message": message,
    }
    return AzureError(400, {**body, "error": {"code": "invalid_parameter", "message": message}})


@dataclass(frozen=True)
class AzureInfo:
    """``GET /info``: the model's name, type and provider."""

    name: str
    model_type: str

    async def info(self, request: Request) -> Response:
        try:
            check_api_version(request)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse(
            {
                "model_name": self.name,
                "model_type": self.model_type,
                "model_provider_name": "pdserve",
            }
        )


def create_info_router(name: str, model_type: str) -> APIRouter:
    return create_router(("GET", "/info", AzureInfo(name, model_type).info), prefixes=PREFIXES)


class AzureRoutes(Door):
    """The chat and image-embeddings handlers over one service and model."""

    async def chat(self, request: Request) -> Response:
        try:
            check_api_version(request)
            body = await read_object(request, self.body_limit_mb)
            extras = split_extras(request, body)
            tools = read_tools(body)
            prompt = await read_prompt(body, "chat", self.model, tools)
            if input_blocked(self.model, prompt):
                raise content_filtered()
            known = {k: v for k, v in body.items() if k in CHAT_KEYS}
            params = openai_sampling({**known, **extras}, self.model.vocab_size, 512)
            client = client_of(request)
            constraint = await azure_constraint(body, self.model, client)
            params = replace(params, constraint=constraint)
            params = await with_tool_constraint(self.model, tools, params, client)  # tools' wins
        except ToolError as exc:  # ``loc``: the body's field; the message names the part
            return error_response(invalid_parameter(exc.field, exc.message, exc.value))
        except APIError as exc:
            return error_response(exc)
        answer = tool_completion(self.model, tools, len(prompt.ids))
        events = self.generation(request, prompt.ids, params)
        return await respond(events, answer, bool(body.get("stream")), error_response)

    async def images_embeddings(self, request: Request) -> Response:
        return error_response(_error(404, "NotFound", "Modality not supported by the model"))


def create_azure_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    routes = AzureRoutes(service, model, body_limit_mb)
    return create_router(
        ("GET", "/info", AzureInfo(model.name, "chat-completion").info),
        ("POST", "/chat/completions", routes.chat),
        ("POST", "/images/embeddings", routes.images_embeddings),
        prefixes=PREFIXES,
    )
