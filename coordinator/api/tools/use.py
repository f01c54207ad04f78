"""Tool calls at a chat door (OpenAI's ``/v1/chat/completions``, Azure's ``/chat/completions``),
in the order the door takes them:

1. :func:`~coordinator.api.tools.read_tools` reads and bounds ``tools``, ``tool_choice`` and
   ``parallel_tool_calls`` (a :class:`~coordinator.api.tools.ToolError` is 400);
2. the prompt renders the offered tools, the history's calls and tool results
   (:func:`~coordinator.api.openai_request.read_prompt` with the request's tools;
   :mod:`~coordinator.api.tools.prompt`);
3. :func:`with_tool_constraint` puts the grammar of ``required`` or a named choice on the
   sampling settings, compiled first (:mod:`~coordinator.api.tools.grammar`): it replaces a
   ``response_format``'s constraint, as the calls are the answer;
4. :func:`tool_completion` is the answer that reads the calls out of the text
   (:mod:`~coordinator.api.tools.answer`), in the format :func:`tool_parser` picks.

``tool_choice: "none"`` renders no tool and parses nothing: a plain answer.
"""

from __future__ import annotations

import dataclasses

from coordinator.api.clients import UNLIMITED, Client
from coordinator.api.openai_format import Completion
from coordinator.api.tools.answer import ToolCompletion
from coordinator.api.tools.grammar import check_constraint, tool_constraint
from coordinator.api.tools.parsers import BaseToolParser, select_parser
from coordinator.api.tools.prompt import renders_tools
from coordinator.api.tools.request import ToolRequest
from coordinator.model_info import ModelInfo
from engine.sampling_params import SamplingParams


def tool_parser(model: ModelInfo, tools: ToolRequest) -> BaseToolParser:
    """The parser of the calls the served model writes."""
    parser = select_parser(model.tokenizer, renders_tools(model.tokenizer))
    return parser(tools.names)


async def with_tool_constraint(
    model: ModelInfo, tools: ToolRequest | None, params: SamplingParams, client: Client = UNLIMITED
) -> SamplingParams:
    """``params`` constrained to the calls ``tools`` forces (unchanged for ``auto``, ``none``
    and no tools), a new grammar charged to ``client``'s compiles a minute; 400 when the
    grammar does not compile."""
    if tools is None:
        return params
    constraint = tool_constraint(tools, type(tool_parser(model, tools)))
    if constraint is None:
        return params
    await check_constraint(model, constraint, tools, client)
    return dataclasses.replace(params, constraint=constraint)


def tool_completion(
    model: ModelInfo, tools: ToolRequest | None, num_prompt_tokens: int
) -> Completion:
    """The chat answer: one that reads tool calls when the model may make them."""
    if tools is None or tools.mode == "none":
        return Completion(
            "chat", model.name, num_prompt_tokens, model.content_filter, prompt_details=True
        )
    parser = tool_parser(model, tools)
    return ToolCompletion(model.name, num_prompt_tokens, parser, model.content_filter)
