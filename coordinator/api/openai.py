"""OpenAI-style routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A request's life: the body is read and validated (:mod:`~coordinator.api.openai_request`), the
prompt tokenized and checked by the content filter; the service generates, and the answer is
streamed or collected whole (:mod:`~coordinator.api.openai_format`), its ``usage`` with
``prompt_tokens_details.cached_tokens``. Chat reads ``tools`` first and answers with the calls
the model makes (:mod:`~coordinator.api.tools.use`). Refusals answer 400 with OpenAI's error body;
service errors their own status with ``type: "server_error"``. Every route is also served under
``/openai`` (``/openai/v1/chat/completions``, …): Azure OpenAI's v1 API, where ``api-version`` is
optional.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.azure import API_VERSIONS
from coordinator.api.clients import client_of
from coordinator.api.common import Door, Handler, Route, create_router, read_object, respond
from coordinator.api.errors import APIError, OpenAIError
from coordinator.api.openai_fields import check_fields
from coordinator.api.openai_format import Completion
from coordinator.api.openai_request import (
    input_blocked,
    openai_constraint,
    openai_logprobs,
    openai_sampling,
    prompt_field,
    read_prompt,
)
from coordinator.api.tools.request import read_tools
from coordinator.api.tools.use import tool_completion, with_tool_constraint
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo

DEFAULT_MAX_TOKENS = {"text": 16, "chat": 512}
# Azure OpenAI's v1 API: OpenAI's routes under /openai/v1, ``api-version`` optional
AZURE_V1 = "/openai"
AZURE_V1_VERSIONS = ("v1", "preview", "latest", *API_VERSIONS)


def error_response(error: APIError) -> JSONResponse:
    """OpenAI's error body for a refused request."""
    if not isinstance(error, OpenAIError):
        error = OpenAIError(error.status, error.message, retry_after_s=error.retry_after_s)
    return error.response()


def service_error_response(error: APIError) -> JSONResponse:
    kind = "server_error"
    return OpenAIError(
        error.status, error.message, kind=kind, retry_after_s=error.retry_after_s
    ).response()


@dataclass(frozen=True)
class ModelList:
    """``GET /v1/models``: the one served model."""

    name: str

    async def models(self) -> JSONResponse:
        model = {"id": self.name, "object": "model", "created": 0, "owned_by": "pdserve"}
        return JSONResponse({"object": "list", "data": [model]})


def azure_v1(handler: Handler) -> Handler:
    """``handler`` as Azure OpenAI's v1 API serves it: an ``api-version`` query, when there is
    one, must be one it knows (400 naming it, OpenAI's body)."""

    takes_request = bool(inspect.signature(handler).parameters)

    async def checked(request: Request) -> Response:
        version = request.query_params.get("api-version")
        if version is not None and version not in AZURE_V1_VERSIONS:
            valid = ", ".join(AZURE_V1_VERSIONS)
            message = f"'api-version' must be absent or one of {valid}, got {json.dumps(version)}"
            return error_response(OpenAIError(400, message, "api-version"))
        return await (handler(request) if takes_request else handler())

    return checked


def openai_routes(*routes: Route) -> list[Route]:
    """``routes`` at their OpenAI paths and under Azure OpenAI's ``/openai`` (:func:`azure_v1`)."""
    aliases = [(method, AZURE_V1 + path, azure_v1(handler)) for method, path, handler in routes]
    return [*routes, *aliases]


def create_models_router(name: str) -> APIRouter:
    return create_router(*openai_routes(("GET", "/v1/models", ModelList(name).models)))


class OpenAIRoutes(Door):
    """The completion handlers over one service and model."""

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def _complete(self, request: Request, kind: str) -> Response:
        try:
            body = await read_object(request, self.body_limit_mb)
            check_fields(body, kind)
            tools = read_tools(body) if kind == "chat" else None
            prompt = await read_prompt(body, kind, self.model, tools)
            if input_blocked(self.model, prompt):
                field = prompt_field(kind)
                raise OpenAIError(400, "The response was filtered", field, code="content_filter")
            params = openai_sampling(body, self.model.vocab_size, DEFAULT_MAX_TOKENS[kind])
            params = replace(params, logprobs=openai_logprobs(body, kind))
            client = client_of(request)
            constraint = await openai_constraint(body, self.model, client)
            params = replace(params, constraint=constraint)
            params = await with_tool_constraint(self.model, tools, params, client)  # tools' wins
        except APIError as exc:
            return error_response(exc)
        answer = (
            tool_completion(self.model, tools, len(prompt.ids))
            if kind == "chat"
            else Completion(kind, self.model.name, len(prompt.ids), self.model.content_filter, True)
        )
        if params.logprobs >= 0:
            answer.token_text = self.model.token_text
        # usage only when asked, in a chunk of its own (checked: true or false)
        answer.stream_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        key = body.get("prompt_cache_key")  # a session (checked: a string of at most 512)
        events = self.generation(request, prompt.ids, params, cache_key=key)
        return await respond(events, answer, bool(body.get("stream")), service_error_response)


def create_openai_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    routes = OpenAIRoutes(service, model, body_limit_mb)
    return create_router(
        *openai_routes(
            ("GET", "/v1/models", ModelList(model.name).models),
            ("POST", "/v1/completions", routes.completions),
            ("POST", "/v1/chat/completions", routes.chat_completions),
        )
    )
