"""A chat request's tools, read and bounded: ``tools``, ``tool_choice``, ``parallel_tool_calls``
(OpenAI's fields; the Azure door takes the same ones) as one :class:`ToolRequest`.

- ``tools``: up to :data:`MAX_TOOLS` ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``; a name is 1 to 64 characters of ``[A-Za-z0-9_-]`` and unique; a
  ``parameters`` JSON schema (an object; absent: no arguments) is at most
  :data:`~engine.constraint.MAX_SPEC_CHARS` characters of JSON, the whole list at most
  :data:`MAX_TOOLS_CHARS`. An empty list is no tools.
- ``tool_choice``: ``"none"`` (the model is told of no tool and nothing is parsed), ``"auto"``
  (the default: free text, calls parsed from it), ``"required"`` (at least one call, forced by a
  grammar), or ``{"type": "function", "function": {"name": N}}`` (exactly one call of ``N``).
  It needs ``tools``.
- ``parallel_tool_calls``: whether a ``required`` answer may hold several calls (default true).

Every refusal is a :class:`ToolError`: 400 naming the parameter, the valid form and the value
received cut short; the OpenAI door answers it as it is, the Azure door with ``loc: ["body",
<field>]``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from coordinator.api.chat_prompt import shown
from coordinator.api.errors import OpenAIError
from coordinator.api.structured_request import checked_name
from engine.constraint import MAX_SPEC_CHARS

MAX_TOOLS = 128  # tools of one request
MAX_TOOLS_CHARS = 4 * MAX_SPEC_CHARS  # characters of the whole tools list's JSON
MODES = ("none", "auto", "required")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(OpenAIError):
    """A tool field refused (400); ``field`` is the body's top-level key it lies in."""

    def __init__(self, param: str, message: str, value: Any = None) -> None:
        super().__init__(400, message, param)
        self.field = re.split(r"[.\[]", param, maxsplit=1)[0]
        self.value = value


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI form (what a chat template's ``tools`` takes)."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """The tools of a request and how they may be used. ``mode``: one of :data:`MODES` or
    ``"named"`` (then ``name`` is the one function to call)."""

    tools: tuple[Tool, ...]
    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is told of (none for ``tool_choice: "none"``)."""
        return () if self.mode == "none" else self.tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.name for tool in self.tools)

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a grammar forces a call of (none for ``auto`` and ``none``)."""
        if self.mode == "named":
            return tuple(tool for tool in self.tools if tool.name == self.name)
        return self.tools if self.mode == "required" else ()


def read_tools(body: dict) -> ToolRequest | None:
    """The request's tools, validated; None when it has none (then ``tool_choice`` and
    ``parallel_tool_calls`` must be absent)."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if not tools:
        for key, value in (("tool_choice", choice), ("parallel_tool_calls", parallel)):
            if value is not None:
                raise ToolError(key, f"'{key}' needs a non-empty 'tools', got {shown(value)}")
        return None
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            "parallel_tool_calls",
            f"'parallel_tool_calls' must be true or false, got {shown(parallel)}",
            parallel,
        )
    mode, name = _choice(choice, {tool.name for tool in tools})
    return ToolRequest(tools, mode, name, True if parallel is None else parallel)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise ToolError("tools", f"'tools' must be a list of functions, got {shown(value)}")
    if len(value) > MAX_TOOLS:
        raise ToolError("tools", f"'tools' may hold at most {MAX_TOOLS} tools, got {len(value)}")
    size = len(json.dumps(value))
    if size > MAX_TOOLS_CHARS:
        raise ToolError(
            "tools", f"'tools' may be at most {MAX_TOOLS_CHARS} characters of JSON, got {size}"
        )
    tools = tuple(_tool(index, entry) for index, entry in enumerate(value))
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            param = f"tools[{index}].function.name"
            raise ToolError(param, f"'{param}' repeats the name {shown(tool.name)}", tool.name)
        seen.add(tool.name)
    return tools


def _tool(index: int, entry: Any) -> Tool:
    param = f"tools[{index}]"
    form = '{"type": "function", "function": {"name", "description", "parameters", "strict"}}'
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise ToolError(param, f"'{param}' must be {form}, got {shown(entry)}", entry)
    function = entry.get("function")
    if not isinstance(function, dict):
        raise ToolError(
            f"{param}.function",
            f'\'{param}.function\' must be an object {{"name", "description", '
            f'"parameters", "strict"}}, got {shown(function)}',
            function,
        )
    return Tool(
        checked_name(f"{param}.function.name", function.get("name"), ToolError),
        _string(f"{param}.function.description", function.get("description")),
        _parameters(f"{param}.function.parameters", function.get("parameters")),
        _strict(f"{param}.function.strict", function.get("strict")),
    )


def _string(param: str, value: Any) -> str:
    if value is not None and not isinstance(value, str):
        raise ToolError(param, f"'{param}' must be a string, got {shown(value)}", value)
    return value or ""


def _strict(param: str, value: Any) -> bool:
    if value is not None and not isinstance(value, bool):
        raise ToolError(param, f"'{param}' must be true or false, got {shown(value)}", value)
    return bool(value)


def _parameters(param: str, value: Any) -> dict[str, Any]:
    if value is None:
        return NO_ARGUMENTS
    if not isinstance(value, dict):
        raise ToolError(param, f"'{param}' must be a JSON schema object, got {shown(value)}")
    size = len(json.dumps(value))
    if size > MAX_SPEC_CHARS:
        raise ToolError(
            param, f"'{param}' may be at most {MAX_SPEC_CHARS} characters of JSON, got {size}"
        )
    return value


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in MODES:
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            "tool_choice",
            '\'tool_choice\' must be one of "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {shown(value)}',
            value,
        )
    if name not in names:
        raise ToolError(
            "tool_choice",
            f"'tool_choice' names {shown(name)}, which is none of the given tools",
            value,
        )
    return "named", name


def tool_chars(body: dict) -> int:
    """The characters a request's tools add to its prompt: the tools' JSON and the history's
    tool calls (names and arguments), whatever their shape (counted before validation)."""
    tools = body.get("tools")
    chars = len(json.dumps(tools)) if isinstance(tools, list) else 0
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                chars += sum(
                    len(function[key])
                    for key in ("name", "arguments")
                    if isinstance(function.get(key), str)
                )
    return chars
