"""The grammar that makes ``tool_choice: "required"`` and a named ``tool_choice`` true.

Both are a Lark :class:`~engine.constraint.Constraint` (llguidance's dialect) over the calls the
model's parser reads (:mod:`~coordinator.api.tools.parsers`), each call's arguments the function's
``parameters`` schema embedded with ``%json``. For ``hermes``::

    start: call ("\\n" call)*            # "required" with parallel_tool_calls; else: start: call
    call: call_0 | call_1
    call_0: "<tool_call>{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}</tool_call>"
    args_0: %json {...the parameters schema...}

A named choice is the one function's call, once. The JSON is written as ``json.dumps`` writes it
(``", "`` and ``": "``, no other whitespace); a schema that is not ``strict`` ignores keywords the
grammar library does not implement instead of refusing them. The grammar travels with the
request like any constraint; a ``response_format`` on the same request gives way to it.

:func:`check_constraint` compiles it at the door against the served tokenizer (once per distinct
grammar, cached), so a schema that does not compile is the client's 400 before a worker sees it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.concurrency import run_in_threadpool

from coordinator.api.clients import UNLIMITED, Client
from coordinator.api.structured_request import charge_compile
from coordinator.api.tools.parsers import BaseToolParser
from coordinator.api.tools.request import Tool, ToolError, ToolRequest
from coordinator.model_info import ModelInfo
from engine.constraint import MAX_SPEC_CHARS, Constraint
from engine.errors import ConfigError
from engine.grammars import JSON_OPTIONS, GrammarError


def tool_constraint(tools: ToolRequest, parser: type[BaseToolParser]) -> Constraint | None:
    """The grammar forcing the calls ``tools`` asks for (None for ``auto`` and ``none``)."""
    forced = tools.forced
    if not forced:
        return None
    several = tools.mode == "required" and tools.parallel
    start = f"start: call ({json.dumps(parser.separator)} call)*" if several else "start: call"
    rules = [start, "call: " + " | ".join(f"call_{i}" for i in range(len(forced)))]
    for index, tool in enumerate(forced):
        before, after = parser.call_text(tool.name)
        rules.append(f"call_{index}: {json.dumps(before)} args_{index} {json.dumps(after)}")
        rules.append(f"args_{index}: %json {json.dumps(_schema(tool))}")
    grammar = "\n".join(rules) + "\n"
    if len(grammar) > MAX_SPEC_CHARS:
        raise ToolError(
            "tools",
            f"the grammar of the tools' calls would be {len(grammar)} characters; at most "
            f"{MAX_SPEC_CHARS} are compiled (fewer or smaller parameters schemas)",
        )
    return Constraint("lark", grammar)


def _schema(tool: Tool) -> dict[str, Any]:
    guidance = tool.parameters.get("x-guidance")
    layout = {**JSON_OPTIONS, **({} if tool.strict else {"lenient": True})}
    return {**tool.parameters, "x-guidance": {**layout, **(guidance or {})}}


async def check_constraint(
    model: ModelInfo, constraint: Constraint, tools: ToolRequest, client: Client = UNLIMITED
) -> None:
    """Compile ``constraint`` (the grammar of ``tools``) off the loop, a new one charged to
    ``client`` (:func:`~coordinator.api.structured_request.charge_compile`); a
    :class:`ToolError` naming the tool whose parameters schema does not compile (``tools`` when
    it is not known)."""
    charge_compile(model, constraint, client)
    try:
        await run_in_threadpool(model.grammar_cache().compile, constraint)
    except (GrammarError, ConfigError) as exc:
        param = _failing_tool(str(exc), tools)
        raise ToolError(param, f"'{param}' does not compile: {exc}") from exc


def _failing_tool(error: str, tools: ToolRequest) -> str:
    """The parameter of the tool a compile error's line (``at <line>(<column>)``) lies in: the
    grammar has two lines before the calls and two lines a call (its rule, its arguments)."""
    found = re.search(r"\bat (\d+)\(", error)
    number = (int(found.group(1)) - 3) // 2 if found else -1
    if not 0 <= number < len(tools.forced):
        return "tools"
    return f"tools[{tools.tools.index(tools.forced[number])}].function.parameters"
