"""Chat messages as the prompt the model reads: their roles checked, rendered with the model's
chat template, and tokenized so that only the template writes control tokens.

A message's ``role`` is one of :data:`ROLES` (else 400 naming ``messages[i].role``, the allowed
values and the value received, cut to :data:`SHOWN_CHARS`). Text in a message that spells one of
the tokenizer's control tokens (its special tokens, and the added tokens its template writes,
e.g. ``<|im_start|>``) is tokenized as ordinary text: the tokenizer's
``sanitize_control_tokens`` marks it before rendering, so the ids of the template's own control
tokens are the only control ids in the prompt, and a prompt without such text gets exactly the
ids it always had. A tokenizer that cannot do that (an older ``transformers``) refuses such
messages with 400 instead. A conversation the template itself refuses (``raise_exception``) is
400 with the template's message.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any

import jinja2

from coordinator.api.errors import OpenAIError

ROLES = ("system", "user", "assistant", "tool")
SHOWN_CHARS = 64  # how much of a refused value an error message shows


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its token ids, and its text when the content filter reads it."""

    ids: list[int]
    text: str | None = None


def shown(value: Any) -> str:
    """``value`` as JSON, cut to :data:`SHOWN_CHARS` characters (``...`` marks a cut)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def check_roles(messages: list[dict]) -> None:
    """400 naming the first message whose ``role`` is not one of :data:`ROLES`."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            name = f"messages[{index}].role"
            raise OpenAIError(
                400, f"'{name}' must be one of {', '.join(ROLES)}, got {shown(role)}", name
            )


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], with_text: bool, tools: list | None = None
) -> ChatPrompt:
    """The prompt of ``messages`` (``{role, content}`` strings, and the tool fields of
    :mod:`~coordinator.api.tools.prompt`); blocking: run it off the loop. ``with_text``: keep
    the rendered text too (for the content filter). ``tools``: the template's own ``tools``."""
    options: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        text = _render(tokenizer, messages, tokenize=False, **options) if with_text else None
        if sanitizes(tokenizer):
            options["sanitize_control_tokens"] = True
        else:
            _refuse_control_text(tokenizer, messages, tools)
        ids = _render(tokenizer, messages, tokenize=True, **options)
    except jinja2.TemplateError as exc:
        message = f"the model's chat template refused the messages: {str(exc)[:200]}"
        raise OpenAIError(400, message, "messages") from exc
    except ValueError as exc:
        if not str(exc).startswith("Can't sanitize"):
            raise  # not the messages' fault (a tokenizer without a chat template): a 500
        # the tokenizer makes that control token out of plain text: it cannot be kept as text
        message = f"the messages cannot be tokenized: {str(exc)[:200]}"
        raise OpenAIError(400, message, "messages") from exc
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return ChatPrompt(list(ids), text)


def _render(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> Any:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **options)


def sanitizes(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` can tokenize control-token text in messages as text."""
    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "sanitize_control_tokens" in parameters


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (none for a tokenizer without any)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return tuple(t.content for t in added.values() if getattr(t, "special", False) and t.content)


def _refuse_control_text(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> None:
    """400 for a message (or tool) whose text spells a control token (a tokenizer that cannot
    sanitize)."""
    tokens = control_tokens(tokenizer)
    texts = [(f"messages[{i}].content", _text_of(m)) for i, m in enumerate(messages)]
    for name, text in [*texts, ("tools", json.dumps(tools or [], ensure_ascii=False))]:
        found = next((t for t in tokens if t in text), None)
        if found is not None:
            raise OpenAIError(
                400, f"'{name}' holds {shown(found)}, a control token of this model", name
            )


def _text_of(message: dict[str, Any]) -> str:
    """A message's content, and its tool calls' JSON where it has any."""
    calls = message.get("tool_calls")
    return message["content"] + (json.dumps(calls, ensure_ascii=False) if calls else "")
