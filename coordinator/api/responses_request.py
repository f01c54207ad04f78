"""What an OpenAI Responses request (``POST /v1/responses``) asks for, validated and turned into
the chat the chat door reads (:mod:`~coordinator.api.openai_request`,
:mod:`~coordinator.api.tools`).

- ``input``: a string (one user message) or items: messages (``role`` user, assistant, system or
  developer; ``content`` a string or ``input_text`` / ``output_text`` parts), ``function_call``
  (``call_id``, ``name``, ``arguments``) and ``function_call_output`` (``call_id``, ``output``);
  earlier turns' ``reasoning`` items are dropped. Images, files and audio are refused: the model
  reads text only. ``instructions``: a system message first (not carried to a later request).
- ``previous_response_id``: the stored conversation that led to that response, then this input
  (:mod:`~coordinator.api.responses_store`).
- ``tools``: function tools ``{type: function, name, description, parameters, strict}`` (hosted
  tools are refused naming ``tools[i].type``); ``tool_choice`` ``auto``, ``none``, ``required``
  or ``{type: function, name}``; ``parallel_tool_calls``.
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
  ``strict``) through the structured-output grammar.
- ``max_output_tokens``, ``temperature``, ``top_p``; ``include: ["message.output_text.logprobs"]``
  with ``top_logprobs`` (0 to 20) returns each token's log probabilities.
- Accepted as they are: ``model``, ``metadata``, ``user``, ``safety_identifier``,
  ``prompt_cache_key``, ``service_tier`` (``auto``, ``default``), ``stream_options``,
  ``truncation: disabled``, ``reasoning`` without an effort, ``include`` of
  ``reasoning.encrypted_content`` (there is no reasoning to include). Refused naming the field:
  ``background``, ``conversation``, ``prompt``, ``max_tool_calls``, ``truncation: auto``, a
  ``reasoning`` effort, and any field the API does not define.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from coordinator.api.chat_prompt import shown
from coordinator.api.errors import OpenAIError
from coordinator.api.limits import MAX_MESSAGES
from engine.sampling_params import MAX_TOP_LOGPROBS

LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content")
DEFAULT_MAX_OUTPUT_TOKENS = 4096
HONOURED = frozenset(
    {
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
        "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
        "include", "top_logprobs", "metadata", "user", "safety_identifier", "prompt_cache_key",
        "service_tier", "stream_options", "truncation", "reasoning",
    }
)  # fmt: skip
OFF_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "responses are not run in the background"),
    "conversation": ((None,), "conversations are not stored; use previous_response_id"),
    "prompt": ((None,), "there are no stored prompts"),
    "max_tool_calls": ((None,), "the model's calls are not capped in number"),
    "truncation": ((None, "disabled"), "an input over the context is refused, never cut"),
    "service_tier": ((None, "auto", "default"), "there is one service tier (auto)"),
}
TEXT_PARTS = ("input_text", "output_text", "text")
DROPPED = ("reasoning",)  # earlier turns' reasoning: not part of the prompt


def invalid(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param)


@dataclass
class ResponsesRequest:
    """``chat``: the OpenAI-form chat body (``messages``, ``tools``, ``tool_choice``,
    ``parallel_tool_calls``, ``response_format``); ``sampling``: its sampling fields;
    ``items``: this request's input as items (what a stored response keeps)."""

    chat: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    logprobs: int = -1  # SamplingParams.logprobs


def read_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """``body`` validated (its input items not yet joined to a previous response's)."""
    for name, value in body.items():
        if name in OFF_VALUES:
            offs, why_not = OFF_VALUES[name]
            if value not in offs:
                why = f"'{name}' is not supported here: {why_not}; got {shown(value)}"
                raise invalid(name, why)
        elif name not in HONOURED:
            raise invalid(name, f"Unrecognized request argument supplied: {name}")
    _check_reasoning(body.get("reasoning"))
    asked = ResponsesRequest(items=input_items(body.get("input")))
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise invalid("previous_response_id", f"'previous_response_id' must be a response id, "
                      f"got {shown(previous)}")  # fmt: skip
    asked.previous_response_id = previous
    asked.stream, asked.store = _flag(body, "stream", False), _flag(body, "store", True)
    asked.logprobs = _logprobs(body)
    asked.sampling = _sampling(body)
    tools = _tools(body.get("tools"))
    if tools:
        asked.chat["tools"] = tools
    for name in ("tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            asked.chat[name] = _tool_choice(body[name]) if name == "tool_choice" else body[name]
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        asked.chat["response_format"] = response_format
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", f"'instructions' must be a string, got {shown(instructions)}")
    asked.chat["instructions"] = instructions
    return asked


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat of ``items`` (a previous conversation's and this request's), ``instructions``
    first."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": item["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})  # fmt: skip
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(422, f"input may hold at most {MAX_MESSAGES} messages, but got "
                          f"{len(messages)}", "input")  # fmt: skip
    return messages


# ---- input items -----------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` as plain items: ``{type: message, role, text}``, ``{type: function_call,
    call_id, name, arguments}``, ``{type: function_call_output, call_id, output}``."""
    if isinstance(value, str):
        if not value:
            raise invalid("input", "'input' must be a non-empty string or list of items")
        return [{"type": "message", "role": "user", "text": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", f"'input' must be a non-empty string or list of items, "
                      f"got {shown(value)}")  # fmt: skip
    if len(value) > MAX_MESSAGES:
        raise OpenAIError(422, f"input may hold at most {MAX_MESSAGES} items, but got "
                          f"{len(value)}", "input")  # fmt: skip
    items = [_item(f"input[{i}]", item) for i, item in enumerate(value)]
    return [item for item in items if item is not None]


def _item(path: str, item: Any) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        raise invalid(path, f"'{path}' must be an item object, got {shown(item)}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise invalid(f"{path}.role", f"'{path}.role' must be one of user, assistant, "
                          f"system, developer, got {shown(role)}")  # fmt: skip
        return {"type": "message", "role": role, "text": _content(path, item.get("content"))}
    if kind == "function_call":
        call = {key: item.get(key) for key in ("call_id", "name", "arguments")}
        if not all(isinstance(v, str) and v for v in (call["call_id"], call["name"])) or not (
            isinstance(call["arguments"], str)
        ):
            raise invalid(path, f"'{path}' must be {{type: function_call, call_id, name, "
                          f"arguments: string}}, got {shown(item)}")  # fmt: skip
        return {"type": "function_call", **call}
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if isinstance(output, list):
            output = _content(f"{path}.output", output)
        if not isinstance(call_id, str) or not call_id or not isinstance(output, str):
            raise invalid(path, f"'{path}' must be {{type: function_call_output, call_id, "
                          f"output: string}}, got {shown(item)}")  # fmt: skip
        return {"type": "function_call_output", "call_id": call_id, "output": output}
    if kind in DROPPED:
        return None
    raise invalid(f"{path}.type", f"'{path}.type' must be one of message, function_call, "
                  f"function_call_output, reasoning, got {shown(kind)}")  # fmt: skip


def _content(path: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{path}.content", f"'{path}.content' must be a string or a list of "
                      f"text parts, got {shown(content)}")  # fmt: skip
    texts = []
    for index, part in enumerate(content):
        where = f"{path}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise invalid(f"{where}.type", f"'{where}.type': this model reads text only, "
                          f"got {shown(kind)}")  # fmt: skip
        else:
            raise invalid(where, f"'{where}' must be {{type: input_text, text}}, "
                          f"got {shown(part)}")  # fmt: skip
    return "".join(texts)


# ---- the rest -------------------------------------------------------------------------------


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"'{name}' must be true or false, got {json.dumps(value)}")
    return value


def _check_reasoning(reasoning: Any) -> None:
    if reasoning is None:
        return
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort not in (None, "none"):
        raise invalid("reasoning.effort", "'reasoning.effort' is not supported: the model does "
                      f"not reason apart from its answer; got {shown(reasoning)}")  # fmt: skip


def _logprobs(body: dict[str, Any]) -> int:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(i in INCLUDABLE for i in include):
        raise invalid("include", f"'include' may hold {', '.join(INCLUDABLE)}, "
                      f"got {shown(include)}")  # fmt: skip
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS
    ):
        raise invalid("top_logprobs", f"'top_logprobs' must be an integer in "
                      f"[0, {MAX_TOP_LOGPROBS}], got {json.dumps(top)}")  # fmt: skip
    return (top or 0) if LOGPROBS in include else -1


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    limit = body.get("max_output_tokens")
    if limit is None:
        limit = DEFAULT_MAX_OUTPUT_TOKENS
    elif isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit < 2**31:
        raise invalid("max_output_tokens", "'max_output_tokens' must be an integer in "
                      f"[1, {2**31 - 1}], got {json.dumps(limit)}")  # fmt: skip
    sampling: dict[str, Any] = {"max_tokens": limit}
    for name in ("temperature", "top_p"):
        if body.get(name) is not None:
            sampling[name] = body[name]
    return sampling


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("tools", f"'tools' must be a list of function tools, got {shown(tools)}")
    converted = []
    for index, tool in enumerate(tools):
        path = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid(f"{path}.type", f"'{path}.type' must be function (hosted tools are "
                          f"not offered here), got {shown(kind)}")  # fmt: skip
        assert isinstance(tool, dict)
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            name = f"{path}.{sorted(extra)[0]}"
            raise invalid(name, f"Unrecognized request argument supplied: {name}")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}  # fmt: skip
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any) -> Any:
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and set(choice) <= {"type", "name"}
    ):
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none", "required"):
        return choice
    raise invalid("tool_choice", "'tool_choice' must be auto, none, required or {type: function, "
                  f"name}}, got {shown(choice)}")  # fmt: skip


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("text", f"'text' must be {{format, verbosity}}, got {shown(text)}")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "'text.verbosity' is not supported: the model has no "
                      f"verbosity setting; got {shown(text['verbosity'])}")  # fmt: skip
    form = text.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        assert isinstance(form, dict)
        spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("text.format", "'text.format' must be {type: text | json_object | "
                  f"json_schema, ...}}, got {shown(form)}")  # fmt: skip
