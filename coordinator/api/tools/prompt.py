"""Chat messages with tools, calls and tool results, as the model's chat template takes them.

A template whose source mentions ``tools`` renders them itself (:func:`renders_tools`): it gets
``tools=[...]`` (OpenAI's form), assistant messages with their ``tool_calls`` (arguments as
objects) and ``tool`` messages with their ``tool_call_id``.

Any other template (the bundled SmolLM2's among them) reads only ``{role, content}`` text, so
pdserve writes the tools into the prompt itself, in the Hermes form its ``hermes`` parser reads
(:mod:`~coordinator.api.tools.parsers`):

- the tools offered are described at the start of the system message (one is added when there is
  none): each function's JSON on its own line inside ``<tools></tools>``, and how to call one,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (:func:`tools_prompt`);
- an assistant message's ``tool_calls`` become its text, one ``<tool_call>{json}</tool_call>``
  a call after its content (which may then be null);
- a ``tool`` message becomes ``<tool_response>\\n...\\n</tool_response>`` text in a ``tool``
  message, or a ``user`` one when the template refuses the ``tool`` role.

Every message is checked first: ``tool_calls`` must be a list of ``{"id", "type": "function",
"function": {"name", "arguments"}}`` (400 naming ``messages[i].tool_calls[j]``), a ``tool``
message needs its ``tool_call_id`` (400 naming ``messages[i].tool_call_id``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coordinator.api.chat_prompt import ChatPrompt, render_chat, shown
from coordinator.api.errors import OpenAIError
from coordinator.api.tools.request import ToolRequest

CALL_FORM = '{"id", "type": "function", "function": {"name", "arguments"}}'


def template_source(tokenizer: Any) -> str:
    """The text of the tokenizer's chat template(s) ("" for none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools itself."""
    return "tools" in template_source(tokenizer)


@dataclass(frozen=True)
class ChatInput:
    """What the chat template is given: messages, and its ``tools`` argument (None: none)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @property
    def text(self) -> str:
        """Every text the client wrote (contents, calls, tools), for the content filter."""
        texts = [m["content"] for m in self.messages]
        texts += [
            json.dumps(m["tool_calls"], ensure_ascii=False)
            for m in self.messages
            if m.get("tool_calls")
        ]
        texts += [json.dumps(self.tools, ensure_ascii=False)] if self.tools else []
        return "\n".join(texts)


def chat_input(
    tokenizer: Any, messages: list[dict], texts: list[str], tools: ToolRequest | None
) -> ChatInput:
    """The template's input for ``messages`` (role-checked; ``texts``: each one's content as
    text), with the tools ``tools`` offers."""
    native = renders_tools(tokenizer)
    rendered = [
        _message(index, message, text, native)
        for index, (message, text) in enumerate(zip(messages, texts, strict=True))
    ]
    if tools is None or not tools.offered:
        return ChatInput(rendered)
    if native:
        return ChatInput(rendered, [tool.to_dict() for tool in tools.offered])
    return ChatInput(_with_system_text(rendered, tools_prompt(tools)))


def render_tool_chat(tokenizer: Any, chat: ChatInput, with_text: bool) -> ChatPrompt:
    """:func:`~coordinator.api.chat_prompt.render_chat` of ``chat``; blocking. Tool results
    written as text go as ``user`` messages when the template refuses the ``tool`` role."""
    try:
        return render_chat(tokenizer, chat.messages, with_text, tools=chat.tools)
    except OpenAIError:
        as_user = [_as_user(m) for m in chat.messages]
        if as_user == chat.messages:
            raise
        return render_chat(tokenizer, as_user, with_text, tools=chat.tools)


def _as_user(message: dict[str, Any]) -> dict[str, Any]:
    is_result = message["role"] == "tool" and "tool_call_id" not in message
    return {**message, "role": "user"} if is_result else message


def tools_prompt(tools: ToolRequest) -> str:
    """The tools' description pdserve writes into the system message."""
    signatures = "\n".join(json.dumps(t.to_dict(), ensure_ascii=False) for t in tools.offered)
    lines = [
        "You can call functions. Their signatures are inside <tools></tools>, one a line:",
        f"<tools>\n{signatures}\n</tools>",
        "To call a function, answer with "
        '<tool_call>{"name": "<function name>", "arguments": {<its arguments>}}</tool_call>, '
        "one such block for each call.",
    ]
    if tools.mode == "required":
        lines.append("Call at least one function.")
    elif tools.mode == "named":
        lines.append(f"Call the function {tools.name}.")
    return "\n".join(lines)


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{text}\n\n{first['content']}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _message(index: int, message: dict, text: str, native: bool) -> dict[str, Any]:
    role = message["role"]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            name = f"messages[{index}].tool_call_id"
            raise OpenAIError(
                400, f"'{name}' must be the id of the call answered, got {shown(call_id)}", name
            )
        if native:
            return {"role": "tool", "tool_call_id": call_id, "content": text}
        return {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}
    calls = _tool_calls(index, message.get("tool_calls")) if role == "assistant" else []
    if not calls:
        return {"role": role, "content": text}
    if native:
        return {"role": role, "content": text, "tool_calls": calls}
    blocks = [json.dumps(call["function"], ensure_ascii=False) for call in calls]
    written = "\n".join(f"<tool_call>{block}</tool_call>" for block in blocks)
    return {"role": role, "content": f"{text}\n{written}" if text else written}


def _tool_calls(index: int, value: Any) -> list[dict[str, Any]]:
    """A history message's ``tool_calls``, checked, arguments as objects where they are JSON."""
    if value is None:
        return []
    name = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise OpenAIError(400, f"'{name}' must be a list of {CALL_FORM}, got {shown(value)}", name)
    return [_tool_call(f"{name}[{number}]", call) for number, call in enumerate(value)]


def _tool_call(name: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(call, dict):
        call_id, function_name = call.get("id", ""), function.get("name")
        arguments = function.get("arguments", "{}")
        ok = isinstance(function_name, str) and isinstance(call_id, str)
        if ok and isinstance(arguments, str | dict):
            written = {"name": function_name, "arguments": _arguments(arguments)}
            return {"id": call_id, "type": "function", "function": written}
    raise OpenAIError(400, f"'{name}' must be {CALL_FORM}, got {shown(call)}", name)


def _arguments(arguments: str | dict) -> Any:
    """Arguments as an object when their text is JSON (templates write them with ``tojson``)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
