"""Tool calls read out of a model's text, whole or as it streams, by the format the model writes.

Two formats, chosen by the chat template (:func:`select_parser`):

- ``hermes`` (Hermes, Qwen2.5, and pdserve's own tool prompt: :mod:`~coordinator.api.tools.prompt`):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them; the text
  outside them is the answer's content.
- ``llama3_json`` (Llama 3.1+): the whole output is ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` also taken), or several such objects separated by ``;``, maybe after
  ``<|python_tag|>``; any other output is content.

A template that mentions ``<tool_call>`` gets ``hermes``; one that mentions ``<|python_tag|>``,
or ``"parameters"`` among Llama 3's header tokens, ``llama3_json``; every other (and every model
described tools by pdserve's own prompt) ``hermes``.

A call is taken only when it is whole and right: valid JSON naming one of the request's tools
with an object of arguments. Anything else (an unknown name, broken JSON, a call cut short by
``max_tokens``) stays text, never an invented call. Streaming sees the same answer as the whole
text: :class:`ToolCallStream` holds back text that may still become a call (a ``<tool_call>``
begun, or for ``llama3_json`` an output that opens like JSON) and sends each call once it is
whole. Whitespace next to a call is dropped; a text without calls is kept exactly.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from coordinator.api.tools.prompt import template_source

CALL_ID_CHARS = string.ascii_letters + string.digits
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    """``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(CALL_ID_CHARS) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


Segment = str | ToolCall  # a parser's output: text, or a call


def call_of(value: Any, names: frozenset[str], arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """The call ``value`` spells (``{"name", <one of arguments_keys>: {...}}``), or None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), None)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class BaseToolParser(ABC):
    """Splits one answer's text, fed piece by piece, into text and calls."""

    separator: str = ""  # what a grammar writes between two calls

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    @abstractmethod
    def feed(self, text: str) -> list[Segment]:
        """What ``text`` (appended to all before it) settles."""

    @abstractmethod
    def finish(self) -> list[Segment]:
        """What is left when the text is complete."""

    @classmethod
    @abstractmethod
    def call_text(cls, name: str) -> tuple[str, str]:
        """The text a call of ``name`` is written between: (before the arguments, after)."""


class HermesParser(BaseToolParser):
    """``<tool_call>{"name", "arguments"}</tool_call>`` blocks anywhere in the text."""

    separator = "\n"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buffer, self.inside, self.searched = "", False, 0

    def feed(self, text: str) -> list[Segment]:
        self.buffer += text
        found: list[Segment] = []
        while self.buffer:
            if not self.inside and not self._open(found):
                break
            end = self.buffer.find(self.CLOSE, self.searched)
            if end < 0:
                self.searched = max(len(self.buffer) - len(self.CLOSE) + 1, 0)
                break
            block = self.buffer[: end + len(self.CLOSE)]
            self.buffer, self.inside, self.searched = self.buffer[len(block) :], False, 0
            found.append(self._call(block) or block)
        return found

    def _open(self, found: list[Segment]) -> bool:
        """Settle the text before the next ``<tool_call>``; whether one has begun."""
        at = self.buffer.find(self.OPEN)
        kept = at if at >= 0 else len(self.buffer) - _partial_suffix(self.buffer, self.OPEN)
        if kept:
            found.append(self.buffer[:kept])
        self.buffer, self.inside = self.buffer[kept:], at >= 0
        return self.inside

    def _call(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block[len(self.OPEN) : -len(self.CLOSE)])
        except (ValueError, RecursionError):
            return None
        return call_of(value, self.names, ("arguments",))

    def finish(self) -> list[Segment]:
        left, self.buffer, self.inside = self.buffer, "", False
        return [left] if left else []

    @classmethod
    def call_text(cls, name: str) -> tuple[str, str]:
        return f'{cls.OPEN}{{"name": {json.dumps(name)}, "arguments": ', f"}}{cls.CLOSE}"


class Llama3JsonParser(BaseToolParser):
    """The whole output as ``{"name", "parameters"}`` objects separated by ``;``."""

    separator = "; "

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buffer, self.is_text = "", False

    def feed(self, text: str) -> list[Segment]:
        if self.is_text:
            return [text] if text else []
        self.buffer += text
        head = self.buffer.lstrip()
        if not head or head.startswith("{") or _begins(head, PYTHON_TAG):
            return []  # may be calls: held until the end
        self.is_text = True
        left, self.buffer = self.buffer, ""
        return [left]

    def finish(self) -> list[Segment]:
        left, self.buffer = self.buffer, ""
        if not left:
            return []
        calls = self._calls(left)
        if calls is None:
            return [left]
        leading = left[: len(left) - len(left.lstrip())]
        return [leading, *calls] if leading else list(calls)

    def _calls(self, text: str) -> list[Segment] | None:
        text = text.strip().removeprefix(PYTHON_TAG)
        decoder, at = json.JSONDecoder(), 0
        calls: list[Segment] = []
        while True:
            at = _skip_space(text, at)
            try:
                value, at = decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                return None
            call = call_of(value, self.names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            at = _skip_space(text, at)
            if at == len(text):
                return calls
            if text[at] != ";":
                return None
            at += 1

    @classmethod
    def call_text(cls, name: str) -> tuple[str, str]:
        return f'{{"name": {json.dumps(name)}, "parameters": ', "}"


def select_parser(tokenizer: Any, native: bool) -> type[BaseToolParser]:
    """The format of the model's calls: by its chat template when that renders the tools
    (``native``), else ``hermes`` (what pdserve's own tool prompt asks for)."""
    source = template_source(tokenizer) if native else ""
    if HermesParser.OPEN in source:
        return HermesParser
    if PYTHON_TAG in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return Llama3JsonParser
    return HermesParser


@dataclass
class Delta:
    """What a piece of text turned into: text to send and whole calls."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """A parser's segments as :class:`Delta`s, whitespace next to a call dropped: whitespace
    that ends a text is held until more text follows it."""

    def __init__(self, parser: BaseToolParser) -> None:
        self.parser = parser
        self.held, self.after_call = "", False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Delta:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> Delta:
        delta = self._deltas(self.parser.finish())
        delta.text, self.held = delta.text + self.held, ""
        return delta

    def _deltas(self, segments: list[Segment]) -> Delta:
        delta = Delta()
        for segment in segments:
            if isinstance(segment, ToolCall):
                self.held, self.after_call = "", True
                delta.calls.append(segment)
                self.calls.append(segment)
                continue
            if self.after_call:
                segment = segment.lstrip()
                self.after_call = not segment
            text = self.held + segment
            kept = text.rstrip()
            delta.text += kept
            self.held = text[len(kept) :]
        return delta


def parse_tool_calls(parser: BaseToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's content (the text outside its calls) and its calls."""
    stream = ToolCallStream(parser)
    first, last = stream.feed(text), stream.finish()
    return first.text + last.text, first.calls + last.calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _begins(text: str, tag: str) -> bool:
    """Whether ``text`` starts with ``tag``, or is a beginning of it."""
    return text.startswith(tag) or tag.startswith(text)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
