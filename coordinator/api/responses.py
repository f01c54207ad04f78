"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``
(also under Azure OpenAI's ``/openai/v1``), what OpenAI's Codex CLI and the ``openai`` SDK's
``client.responses`` speak.

A request is read into the chat the chat door reads (:mod:`~coordinator.api.responses_request`),
after the conversation of its ``previous_response_id`` when it names one, and goes the same way
from there: the chat template with its tools, the content filter, the sampling settings, the
grammars of ``text.format`` and of ``required`` or a named tool. The answer is shaped by
:mod:`~coordinator.api.responses_format`, whole or as the Responses event stream; with ``store``
(the default) the response and its conversation are kept in a bounded store
(:mod:`~coordinator.api.responses_store`: this coordinator's, or its shared pool's), per
tenant. Errors are OpenAI's body.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api.clients import client_of
from coordinator.api.common import Door, create_router, read_object, respond
from coordinator.api.errors import APIError, OpenAIError
from coordinator.api.openai import error_response, openai_routes, service_error_response
from coordinator.api.openai_request import (
    Prompt,
    input_blocked,
    openai_constraint,
    openai_sampling,
    read_prompt,
)
from coordinator.api.responses_format import ResponseAnswer
from coordinator.api.responses_request import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    ResponsesRequest,
    chat_messages,
    read_responses_request,
)
from coordinator.api.responses_store import ResponseKeeper
from coordinator.api.tenants import tenant_of
from coordinator.api.tools.request import ToolRequest, read_tools
from coordinator.api.tools.use import tool_parser, with_tool_constraint
from coordinator.errors import ServiceError
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.sampling_params import SamplingParams


class ResponsesRoutes(Door):
    """The Responses handlers over one service, model and store."""

    store: ResponseKeeper | None  # None: configured off (request_limit.responses_store_mb 0)

    async def create(self, request: Request) -> Response:
        try:
            body = await read_object(request, self.body_limit_mb)
            asked = read_responses_request(body)
            if self.store is None:
                _refuse_storing(body, asked)
            tenant = tenant_of(request)
            items = [*await self._history(tenant, asked.previous_response_id), *asked.items]
            instructions = asked.chat.pop("instructions")
            chat = {**asked.chat, "messages": chat_messages(items, instructions)}
            tools, prompt = await self._prompt(chat)
            params = await self._params(request, asked, chat, tools)
        except APIError as exc:
            return error_response(exc)
        except ServiceError as exc:  # the store unreachable
            return service_error_response(APIError.from_service(exc))
        parser = tool_parser(self.model, tools) if tools and tools.mode != "none" else None
        token_text = self.model.token_text if params.logprobs >= 0 else None
        answer = ResponseAnswer(_echo(body, asked, instructions), len(prompt.ids), parser,
                                self.model.content_filter, token_text)  # fmt: skip
        store = self.store
        if store is not None and asked.store:

            async def keep(response: dict[str, Any]) -> None:
                await store.put(tenant, response, [*items, *output_items(response)])

            answer.on_done = keep  # before the last event (streamed) or the answer (whole)
        key = body.get("prompt_cache_key")
        events = self.generation(request, prompt.ids, params, cache_key=key)
        answered = await respond(events, answer, asked.stream, service_error_response)
        if answer.on_done is not None and answer.final is not None:  # whole: kept, then sent
            await answer.on_done(answer.final)
        return answered

    async def get(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            stored = await self.store.get(tenant_of(request), response_id) if self.store else None
        except ServiceError as exc:
            return service_error_response(APIError.from_service(exc))
        if stored is None:
            return error_response(_not_found(request.path_params["response_id"]))
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            deleted = self.store is not None and await self.store.delete(
                tenant_of(request), response_id
            )
        except ServiceError as exc:
            return service_error_response(APIError.from_service(exc))
        if not deleted:
            return error_response(_not_found(response_id))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _history(self, tenant: str, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None or self.store is None:
            return []
        stored = await self.store.get(tenant, response_id)
        if stored is None:
            message = f"Previous response with id '{response_id}' not found."
            raise OpenAIError(400, message, "previous_response_id",
                              code="previous_response_not_found")  # fmt: skip
        return stored.conversation

    async def _prompt(self, chat: dict[str, Any]) -> tuple[ToolRequest | None, Prompt]:
        try:
            tools = read_tools(chat)
            prompt = await read_prompt(chat, "chat", self.model, tools)
        except OpenAIError as exc:  # the chat's messages are the request's input
            if exc.param and exc.param.startswith("messages"):
                raise OpenAIError(exc.status, exc.message.replace("messages", "input"),
                                  exc.param.replace("messages", "input")) from exc  # fmt: skip
            raise
        if input_blocked(self.model, prompt):
            raise OpenAIError(400, "The response was filtered", "input", code="content_filter")
        return tools, prompt

    async def _params(
        self, request: Request, asked: ResponsesRequest, chat: dict, tools: ToolRequest | None
    ) -> SamplingParams:
        client = client_of(request)
        params = openai_sampling(asked.sampling, self.model.vocab_size, DEFAULT_MAX_OUTPUT_TOKENS)
        try:
            constraint = await openai_constraint(chat, self.model, client)
        except OpenAIError as exc:  # text.format's schema, named as the request names it
            param = (exc.param or "").replace("response_format.json_schema", "text.format")
            raise OpenAIError(exc.status, exc.message, param or "text.format") from exc
        params = replace(params, constraint=constraint, logprobs=asked.logprobs)
        return await with_tool_constraint(self.model, tools, params, client)


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the plain items a later request's conversation holds."""
    items: list[dict[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            items.append({"type": "message", "role": "assistant", "text": text})
        else:
            items.append({"type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"]})  # fmt: skip
    return items


def _echo(body: dict[str, Any], asked: ResponsesRequest, instructions: str | None) -> dict:
    """The request's own fields a response repeats."""
    return {
        "model": body.get("model") or "",
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": asked.previous_response_id,
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "store": asked.store,
        "top_logprobs": body.get("top_logprobs"),
        "user": body.get("user"),
    }


def _refuse_storing(body: dict[str, Any], asked: ResponsesRequest) -> None:
    """With no store configured, a request that asks for one is 400 naming the field; one that
    leaves ``store`` out is answered and kept nowhere."""
    off = "responses are not stored here (request_limit.responses_store_mb is 0)"
    if body.get("store") is True:
        raise OpenAIError(400, f"'store' must be false: {off}", "store")
    if asked.previous_response_id is not None:
        raise OpenAIError(400, f"'previous_response_id' cannot be used: {off}",
                          "previous_response_id")  # fmt: skip
    asked.store = False


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"No response found with id '{response_id}'.", "response_id")


def create_responses_router(
    service: InferenceService,
    model: ModelInfo,
    body_limit_mb: int,
    store: ResponseKeeper | None = None,
) -> APIRouter:
    """The routes over ``store`` (None: nothing is stored)."""
    routes = ResponsesRoutes(service, model, body_limit_mb)
    routes.store = store
    return create_router(
        *openai_routes(
            ("POST", "/v1/responses", routes.create),
            ("GET", "/v1/responses/{response_id}", routes.get),
            ("DELETE", "/v1/responses/{response_id}", routes.delete),
        )
    )
