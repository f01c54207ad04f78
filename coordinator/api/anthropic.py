"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, what
Claude Code and the ``anthropic`` SDKs speak.

A request is read in Anthropic's terms (:mod:`~coordinator.api.anthropic_request`) into the chat
the OpenAI door reads, and goes the same way from there: the chat template (tools rendered as the
model takes them), the content filter, the sampling settings, a tool grammar for ``any`` or a
named tool, ``output_config.format``'s JSON schema as the structured-output grammar; a last
assistant turn's text is appended to the prompt as the start of the answer. ``max_tokens: 0``
computes the prompt into the prefix cache (its first token is sampled and not sent) and answers
an empty message.
The answer is shaped by :mod:`~coordinator.api.anthropic_format`, whole or as Anthropic's event
stream. The key is read from ``x-api-key`` as from the other doors' headers
(:mod:`~coordinator.api.tenants`); errors are Anthropic's body with the status every door
answers (400 for a field refused, 422 over a shared limit, 413, 429, 503).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api.anthropic_format import MessageAnswer, error_response
from coordinator.api.anthropic_request import (
    MessagesRequest,
    anthropic_names,
    invalid,
    read_messages_request,
)
from coordinator.api.clients import Client, client_of
from coordinator.api.common import Door, create_router, read_object, respond
from coordinator.api.errors import APIError, FormatError, OpenAIError
from coordinator.api.openai_request import Prompt, input_blocked, openai_sampling, read_prompt
from coordinator.api.structured_request import check_compiles, schema_constraint
from coordinator.api.tools.request import ToolRequest, read_tools
from coordinator.api.tools.use import tool_parser, with_tool_constraint
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.constraint import Constraint

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class MessagesRoutes(Door):
    """The Messages handlers over one service and model."""

    async def messages(self, request: Request) -> Response:
        try:
            body = await read_object(request, self.body_limit_mb)
            asked = read_messages_request(body)
            tools, prompt = await self._prompt(asked)
            if input_blocked(self.model, prompt):
                raise invalid("messages: the input was refused by the content filter")
            client = client_of(request)
            sampling = openai_sampling(asked.sampling, self.model.vocab_size, 1)
            constraint = await output_constraint(asked.output_schema, self.model, client)
            sampling = replace(sampling, constraint=constraint)
            params = await with_tool_constraint(self.model, tools, sampling, client)  # tools' wins
        except OpenAIError as exc:
            return error_response(anthropic_names(exc))
        except APIError as exc:
            return error_response(exc)
        parser = None
        if tools is not None and tools.mode != "none":
            parser = tool_parser(self.model, tools)
        answer = MessageAnswer(self.model.name, len(prompt.ids), self.model.tokenizer,
                               asked.stop_sequences, parser, self.model.content_filter)  # fmt: skip
        answer.warm_only = asked.warm_only
        events = self.generation(request, prompt.ids, params)
        return await respond(events, answer, asked.stream, error_response)

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await read_object(request, self.body_limit_mb)
            _, prompt = await self._prompt(read_messages_request(body, counting=True))
        except OpenAIError as exc:
            return error_response(anthropic_names(exc))
        except APIError as exc:
            return error_response(exc)
        return JSONResponse({"input_tokens": len(prompt.ids)})

    async def _prompt(self, asked: MessagesRequest) -> tuple[ToolRequest | None, Prompt]:
        """The request's tools and its prompt: the chat rendered, then the prefill's tokens."""
        tools = read_tools(asked.chat)
        prompt = await read_prompt(asked.chat, "chat", self.model, tools)
        if not asked.prefill:
            return tools, prompt
        encode = self.model.tokenizer.encode
        prefill = await run_in_threadpool(encode, asked.prefill, add_special_tokens=False)
        ids = [*prompt.ids, *prefill]
        if len(ids) > self.model.max_input_tokens:
            raise invalid(f"messages: the prompt has {len(ids)} tokens; this model takes at "
                          f"most {self.model.max_input_tokens}")  # fmt: skip
        return tools, Prompt(ids, f"{prompt.text}\n{asked.prefill}")


async def output_constraint(schema: Any, model: ModelInfo, client: Client) -> Constraint | None:
    """``output_config.format``'s schema as a constraint, compiled once here (a new one charged
    to ``client``); 400 naming ``output_config.format.schema`` when it does not compile."""
    if schema is None:
        return None
    param = "output_config.format.schema"
    try:
        constraint = schema_constraint(param, schema, strict=True)
        await check_compiles(model, constraint, param, client)
    except FormatError as exc:
        raise invalid(exc.message.replace(f"'{param}'", param)) from exc
    return constraint


def create_messages_router(
    service: InferenceService, model: ModelInfo, body_limit_mb: int
) -> APIRouter:
    routes = MessagesRoutes(service, model, body_limit_mb)
    return create_router(
        ("POST", "/v1/messages", routes.messages),
        ("POST", "/v1/messages/count_tokens", routes.count_tokens),
    )
