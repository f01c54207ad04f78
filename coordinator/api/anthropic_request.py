"""What an Anthropic Messages request (``POST /v1/messages``) asks for, validated in Anthropic's
terms and turned into the chat the other doors read (:mod:`~coordinator.api.openai_request`,
:mod:`~coordinator.api.tools`): one path from there on, the same prompt for the same chat.

- ``system``: a string or text blocks, the chat's system message.
- ``messages``: ``user`` and ``assistant`` turns, each a string or a list of blocks. ``text``
  blocks are text; an assistant's ``tool_use`` blocks (``{id, name, input}``) are its calls; a
  user's ``tool_result`` blocks (``{tool_use_id, content, is_error}``) are the results, in
  order, before the user's text. An assistant's ``thinking`` and ``redacted_thinking`` blocks
  from earlier turns are dropped, as Anthropic drops them. A last ``assistant`` turn of text is
  the start of the answer (prefill): the model goes on from it. Images and documents are refused:
  the model reads text only.
- ``tools``: ``{name, description, input_schema}`` (client tools; server tools such as web
  search are refused naming ``tools.N.type``); ``tool_choice``: ``auto``, ``any`` (a call is
  required), ``tool`` (that one), ``none``, with ``disable_parallel_tool_use``.
- Sampling: ``max_tokens`` (required), ``temperature`` and ``top_p`` in [0, 1], ``top_k``,
  ``stop_sequences``; ``metadata`` and ``service_tier`` are accepted (they change no output);
  ``thinking`` only when ``disabled`` (the model does not think). Any other field is 400
  ``<field>: Extra inputs are not permitted``, as Anthropic answers it.

Every refusal is an :class:`~coordinator.api.errors.APIError` whose message names the field by
Anthropic's path (``messages.2.content.0.type``), its valid form and the value received.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from coordinator.api.chat_prompt import shown
from coordinator.api.errors import APIError, OpenAIError
from coordinator.api.limits import MAX_MESSAGES, MAX_STOP_SEQUENCES, count_over, stop_limit_message
from coordinator.api.tools.request import MAX_TOOLS

# the fields of the current API (and the sampling fields older clients send), each honoured
# or, at a value asking for what pdserve does not do, refused
FIELDS = frozenset(
    {
        "model", "max_tokens", "messages", "system", "stop_sequences", "stream", "tools",
        "tool_choice", "thinking", "output_config", "temperature", "top_p", "top_k",
        # accepted: they change no output here
        "metadata", "service_tier", "cache_control", "speed", "inference_geo", "diagnostics",
        "user_profile_id", "workspace_id", "container",
    }
)  # fmt: skip
COUNT_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
     "cache_control", "speed", "user_profile_id", "workspace_id"}
)  # fmt: skip
MAX_BLOCKS = 4 * MAX_MESSAGES  # content blocks of one request, every message's together
SERVICE_TIERS = (None, "auto", "standard_only")
SPEEDS = (None, "standard", "fast")  # one speed here: both are it
EFFORTS = (None, "low", "medium", "high", "xhigh", "max")  # the model does not think: all one
THINKING_TAKEN = ("disabled", "adaptive")  # adaptive: the model decides, and it never thinks
TOOL_KEYS = {
    "type",
    "name",
    "description",
    "input_schema",
    "cache_control",
    "strict",
    "eager_input_streaming",
    "input_examples",
    "defer_loading",
    "allowed_callers",
}
TOOL_CHOICES = ("auto", "any", "tool", "none")
DROPPED = ("thinking", "redacted_thinking")  # earlier turns' reasoning: not part of the prompt


def invalid(message: str, status: int = 400) -> APIError:
    return APIError(status, message, "invalid_request_error")


@dataclass
class MessagesRequest:
    """A Messages request as the chat path reads it: ``chat`` holds OpenAI-form ``messages``,
    ``tools``, ``tool_choice`` and ``parallel_tool_calls``; ``sampling`` the OpenAI-form
    sampling fields; ``prefill`` the text the answer starts from (not sent back);
    ``output_schema``: the JSON schema of ``output_config.format`` (None: free text);
    ``warm_only``: ``max_tokens: 0``, the prompt computed into the prefix cache and nothing
    generated."""

    chat: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    prefill: str = ""
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()
    output_schema: Any = None
    warm_only: bool = False


def read_messages_request(body: dict[str, Any], counting: bool = False) -> MessagesRequest:
    """``body`` validated and turned into a :class:`MessagesRequest`; ``counting``: the body of
    ``/v1/messages/count_tokens`` (no sampling fields, no ``max_tokens``)."""
    allowed = COUNT_FIELDS if counting else FIELDS
    for key in body:
        if key not in allowed:
            raise invalid(f"{key}: Extra inputs are not permitted")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(f"model: Field required (a model name), got {shown(model)}")
    _check_thinking(body.get("thinking"))
    _check_accepted(body)
    messages, prefill = _messages(body.get("messages"), _system(body.get("system")))
    chat: dict[str, Any] = {"messages": messages}
    chat.update(_tools(body.get("tools"), body.get("tool_choice")))
    asked = MessagesRequest(chat, prefill=prefill)
    asked.output_schema = _output_schema(body.get("output_config"))
    if not counting:
        asked.sampling = _sampling(body)
        asked.warm_only = asked.sampling["max_tokens"] == 0
        if asked.warm_only:
            asked.sampling["max_tokens"] = 1  # the prompt's first token is computed, not sent
        asked.stop_sequences = tuple(asked.sampling.get("stop", ()))
        asked.stream = _flag(body, "stream")
    return asked


# ---- sampling ---------------------------------------------------------------------------------


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    if "max_tokens" not in body:
        raise invalid("max_tokens: Field required")
    sampling = {"max_tokens": _number(body, "max_tokens", 0, 2**31 - 1, True)}
    for name, high in (("temperature", 1.0), ("top_p", 1.0)):
        if body.get(name) is not None:
            sampling[name] = _number(body, name, 0, high, False)
    if body.get("top_k") is not None:
        sampling["top_k"] = _number(body, "top_k", 0, 2**31 - 1, True)
    stop = body.get("stop_sequences")
    if stop is not None:
        form = f"a list of up to {MAX_STOP_SEQUENCES} non-empty strings"
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise invalid(f"stop_sequences: must be {form}, got {shown(stop)}")
        if over := stop_limit_message("stop_sequences", stop):
            raise invalid(f"stop_sequences: {over}")
        sampling["stop"] = stop
    return sampling


def _number(body: dict[str, Any], name: str, low: float, high: float, integer: bool) -> Any:
    value = body[name]
    ok = isinstance(value, int if integer else int | float) and not isinstance(value, bool)
    if not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        bounds = f"[{int(low)}, {int(high)}]" if integer else f"[{low:g}, {high:g}]"
        raise invalid(f"{name}: must be {kind} in {bounds}, got {shown(value)}")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"{name}: must be true or false, got {shown(value)}")
    return value


def _check_accepted(body: dict[str, Any]) -> None:
    """The fields that change no output: checked for their form only."""
    metadata = body.get("metadata")
    if metadata is not None:
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        if (
            not isinstance(metadata, dict)
            or set(metadata) - {"user_id"}
            or (user is not None and not isinstance(user, str))
        ):
            raise invalid(f"metadata: must be {{user_id: string}}, got {shown(metadata)}")
    for name, values in (("service_tier", SERVICE_TIERS), ("speed", SPEEDS)):
        if body.get(name) not in values:
            valid = ", ".join(v for v in values if v)
            raise invalid(f"{name}: must be one of {valid}, got {shown(body.get(name))}")
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise invalid(f"{name}: must be a string, got {shown(body[name])}")
    control = body.get("cache_control")
    if control is not None and not _cache_control(control):
        raise invalid(f"cache_control: must be {{type: ephemeral, ttl}}, got {shown(control)}")
    diagnostics = body.get("diagnostics")
    if diagnostics is not None and not isinstance(diagnostics, dict):
        raise invalid(f"diagnostics: must be {{previous_message_id}}, got {shown(diagnostics)}")
    if body.get("container") is not None:
        raise invalid("container: code execution containers are not offered here, "
                      f"got {shown(body['container'])}")  # fmt: skip


def _cache_control(value: Any) -> bool:
    """Whether ``value`` is a cache marker (caching here is automatic: every marker is met)."""
    return isinstance(value, dict) and value.get("type") == "ephemeral"


def _check_thinking(thinking: Any) -> None:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if thinking is None or kind in THINKING_TAKEN:
        return
    raise invalid(
        "thinking: this model does not think; {type: disabled} or {type: adaptive} is taken, "
        f"got {shown(thinking)}"
    )


def _output_schema(config: Any) -> Any:
    """``output_config``: its ``format``'s schema (None: free text); ``effort`` any level."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise invalid(f"output_config: must be {{effort, format}}, got {shown(config)}")
    if config.get("effort") not in EFFORTS:
        valid = ", ".join(e for e in EFFORTS if e)
        raise invalid(f"output_config.effort: must be one of {valid}, "
                      f"got {shown(config.get('effort'))}")  # fmt: skip
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema" or "schema" not in form:
        raise invalid("output_config.format: must be {type: json_schema, schema}, "
                      f"got {shown(form)}")  # fmt: skip
    return form["schema"]


# ---- the conversation -----------------------------------------------------------------------


def _system(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n".join(_text_block(f"system.{i}", b) for i, b in enumerate(system))
    raise invalid(f"system: must be a string or a list of text blocks, got {shown(system)}")


def _text_block(path: str, block: Any) -> str:
    if isinstance(block, dict) and block.get("type") == "text":
        text = block.get("text")
        if isinstance(text, str):
            return text
        raise invalid(f"{path}.text: must be a string, got {shown(text)}")
    raise invalid(f"{path}: must be a text block {{type: text, text}}, got {shown(block)}")


def _messages(value: Any, system: str | None) -> tuple[list[dict[str, Any]], str]:
    """The OpenAI-form chat, and the prefill (a last assistant turn's text)."""
    if not isinstance(value, list) or not value:
        form = "a non-empty list of {role, content}"
        raise invalid(f"messages: must be {form}, got {shown(value)}")
    if over := count_over("messages", "messages", value, MAX_MESSAGES):
        raise invalid(f"messages: {over}")
    blocks = sum(len(m["content"]) for m in value
                 if isinstance(m, dict) and isinstance(m.get("content"), list))  # fmt: skip
    if blocks > MAX_BLOCKS:
        raise invalid(f"messages: may hold at most {MAX_BLOCKS} content blocks, but got {blocks}")
    chat: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    for index, message in enumerate(value):
        path = f"messages.{index}"
        if not isinstance(message, dict):
            raise invalid(f"{path}: must be {{role, content}}, got {shown(message)}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise invalid(f"{path}.role: must be one of user, assistant, got {shown(role)}")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list):
            turn = _user_turn if role == "user" else _assistant_turn
            chat.extend(turn(path, content))
        else:
            raise invalid(f"{path}.content: must be a string or a list of blocks, "
                          f"got {shown(content)}")  # fmt: skip
    prefill = ""
    last = chat[-1]
    if last["role"] == "assistant" and len(value) > 1:
        if last.get("tool_calls"):
            raise invalid(f"messages.{len(value) - 1}: a last assistant turn (the start of the "
                          "answer) may hold text only, not tool_use")  # fmt: skip
        prefill = chat.pop()["content"]
    return chat, prefill


def _user_turn(path: str, content: list[Any]) -> list[dict[str, Any]]:
    """Tool results as ``tool`` messages, text as ``user`` ones, in their order."""
    turn: list[dict[str, Any]] = []
    texts: list[str] = []
    for number, block in enumerate(content):
        where = f"{path}.content.{number}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            if texts:
                turn.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            turn.append(_tool_result(where, block))
        elif kind == "text":
            texts.append(_text_block(where, block))
        else:
            _refuse_block(where, block, "text, tool_result")
    if texts or not turn:
        turn.append({"role": "user", "content": "\n".join(texts)})
    return turn


def _tool_result(path: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{path}.tool_use_id: must be the id of the tool_use answered, "
                      f"got {shown(call_id)}")  # fmt: skip
    content = block.get("content", "")
    if isinstance(content, list):
        text = "\n".join(_text_block(f"{path}.content.{i}", b) for i, b in enumerate(content))
    elif isinstance(content, str):
        text = content
    else:
        raise invalid(f"{path}.content: must be a string or text blocks, got {shown(content)}")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise invalid(f"{path}.is_error: must be true or false, got {shown(is_error)}")
    return {"role": "tool", "tool_call_id": call_id,
            "content": f"Error: {text}" if is_error else text}  # fmt: skip


def _assistant_turn(path: str, content: list[Any]) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for number, block in enumerate(content):
        where = f"{path}.content.{number}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(where, block))
        elif kind == "tool_use":
            calls.append(_tool_use(where, block))
        elif kind not in DROPPED:
            _refuse_block(where, block, "text, tool_use, thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool_use(path: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise invalid(f"{path}: must be {{type: tool_use, id, name, input: object}}, "
                      f"got {shown(block)}")  # fmt: skip
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _refuse_block(path: str, block: Any, valid: str) -> None:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document", "search_result"):
        raise invalid(f"{path}.type: this model reads text only, got {shown(kind)}")
    raise invalid(f"{path}: must be a block of type {valid}, got {shown(block)}")


# ---- tools ----------------------------------------------------------------------------------


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """The OpenAI-form ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (what
    :func:`~coordinator.api.tools.read_tools` reads; its refusals are renamed by
    :func:`anthropic_names`)."""
    if tools is None or tools == []:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if choice is None or kind in ("auto", "none"):
            return {}
        raise invalid(f"tool_choice: needs a non-empty tools, got {shown(choice)}")
    if not isinstance(tools, list):
        raise invalid(f"tools: must be a list of tools, got {shown(tools)}")
    if over := count_over("tools", "tools", tools, MAX_TOOLS):
        raise invalid(f"tools: {over}")
    chat: dict[str, Any] = {"tools": [_tool(f"tools.{i}", t) for i, t in enumerate(tools)]}
    if choice is not None:
        chat.update(_tool_choice(choice))
    return chat


def _tool(path: str, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise invalid(f"{path}: must be {{name, description, input_schema}}, got {shown(tool)}")
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise invalid(f"{path}.type: server tools are not offered here; a tool is "
                      f"{{name, description, input_schema}}, got {shown(kind)}")  # fmt: skip
    extra = set(tool) - TOOL_KEYS
    if extra:
        raise invalid(f"{path}.{sorted(extra)[0]}: Extra inputs are not permitted")
    if "input_schema" not in tool:
        raise invalid(f"{path}.input_schema: Field required")
    if tool.get("defer_loading", False) is not False:
        raise invalid(f"{path}.defer_loading: tool search is not offered here; every tool is "
                      f"loaded, got {shown(tool['defer_loading'])}")  # fmt: skip
    callers = tool.get("allowed_callers", ["direct"])
    if callers != ["direct"]:
        raise invalid(f"{path}.allowed_callers: the model calls tools directly only "
                      f"([direct]), got {shown(callers)}")  # fmt: skip
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    description = tool.get("description")
    examples = tool.get("input_examples")
    if examples is not None:  # shown to the model with the description
        if not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples):
            raise invalid(f"{path}.input_examples: must be a list of objects, "
                          f"got {shown(examples)}")  # fmt: skip
        shown_examples = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
        description = f"{description or ''}\nExamples of input:\n{shown_examples}".strip()
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in TOOL_CHOICES:
        raise invalid(f"tool_choice.type: must be one of {', '.join(TOOL_CHOICES)}, "
                      f"got {shown(choice)}")  # fmt: skip
    assert isinstance(choice, dict)
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise invalid(f"tool_choice.{sorted(extra)[0]}: Extra inputs are not permitted")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise invalid(f"tool_choice.disable_parallel_tool_use: must be true or false, "
                      f"got {shown(single)}")  # fmt: skip
    chat: dict[str, Any] = {"parallel_tool_calls": not single}
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    return chat


def anthropic_names(error: OpenAIError) -> APIError:
    """A refusal of the chat path, its fields named as the Messages request names them
    (``tools[0].function.parameters`` is ``tools.0.input_schema``)."""
    text = re.sub(r"\[(\d+)\]", r".\1", error.message)
    text = text.replace(".function.parameters", ".input_schema").replace(".function.", ".")
    text = text.replace("'tool_choice.function.name'", "'tool_choice.name'")
    return APIError(error.status, text, error.code or error.kind, error.retry_after_s)
