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

A call is taken from its opening, ``{"name": <one of the request's tools>, "arguments": {``
(:mod:`~coordinator.api.tools.call_opening`): from there its arguments stream as the model writes
them (:class:`CallOpened`, then :class:`ArgumentsPiece` s, then the whole :class:`ToolCall`), and
a call cut short (``max_tokens``) or broken keeps its arguments as written. A block that opens
another way is read whole at its close, and taken only when it is valid JSON naming one of the
tools with an object of arguments; anything else (an unknown name) stays text, never an invented
call. Streaming sees the same answer as the whole text: :class:`ToolCallStream` holds back text
that may still become a call (a ``<tool_call>`` begun, or for ``llama3_json`` an output that
opens like JSON). Whitespace next to a call is dropped; a text without calls is kept exactly.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from coordinator.api.tools.call_opening import (
    PARTIAL,
    ArgumentsPiece,
    ArgumentsScanner,
    CallOpened,
    Opening,
    read_opening,
)
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


Segment = str | ToolCall | CallOpened | ArgumentsPiece  # text, a call, or a streamed call's parts


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


class _StreamedCall:
    """The call a parser is reading while it streams: its arguments so far."""

    def __init__(self, name: str, close: str = "") -> None:
        self.id, self.name, self.arguments = new_call_id(), name, ""
        self.scanner = ArgumentsScanner(close)

    def opened(self) -> CallOpened:
        return CallOpened(self.id, self.name)

    def take(self, text: str, found: list[Segment]) -> int:
        """Read the arguments in ``text``: how many characters were arguments."""
        count = self.scanner.scan(text)
        if count:
            self.arguments += text[:count]
            found.append(ArgumentsPiece(text[:count]))
        return count

    def call(self) -> ToolCall:
        """The call as written (cut short, if it was)."""
        return ToolCall(self.name, self.arguments.strip(), self.id)


class HermesParser(BaseToolParser):
    """``<tool_call>{"name", "arguments"}</tool_call>`` blocks anywhere in the text. A block
    that opens ``{"name": <a tool>, "arguments": {`` streams its arguments; any other block is
    read whole at its close."""

    separator = "\n"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buffer, self.inside, self.searched = "", False, 0
        self.whole = False  # the block is read at its close
        self.streamed: _StreamedCall | None = None

    def feed(self, text: str) -> list[Segment]:
        self.buffer += text
        found: list[Segment] = []
        while self.buffer:
            if not self.inside:
                if not self._open(found):
                    break
                self.buffer = self.buffer[len(self.OPEN) :]
            if self.streamed is not None:
                if not self._stream(found):
                    break
                continue
            if not self.whole and not self._decide(found):
                break
            if self.streamed is None and not self._whole(found):
                break
        return found

    def _open(self, found: list[Segment]) -> bool:
        """Settle the text before the next ``<tool_call>``; whether one has begun."""
        at = self.buffer.find(self.OPEN)
        kept = at if at >= 0 else len(self.buffer) - _partial_suffix(self.buffer, self.OPEN)
        if kept:
            found.append(self.buffer[:kept])
        self.buffer, self.inside = self.buffer[kept:], at >= 0
        self.whole, self.searched = False, 0
        return self.inside

    def _decide(self, found: list[Segment]) -> bool:
        """Whether the block's start tells how to read it (streamed or whole)."""
        opening = read_opening(self.buffer, ("arguments",))
        if opening == PARTIAL and self.CLOSE not in self.buffer:
            return False
        if isinstance(opening, Opening) and opening.name in self.names:
            self.streamed = _StreamedCall(opening.name, self.CLOSE)
            found.append(self.streamed.opened())
            self.buffer = self.buffer[opening.end :]
            return True
        self.whole = True
        return True

    def _stream(self, found: list[Segment]) -> bool:
        """Read the streamed call on; whether the buffer was consumed to a decision."""
        call = self.streamed
        assert call is not None
        if not (call.scanner.ended or call.scanner.closed):
            self.buffer = self.buffer[call.take(self.buffer, found) :]
            if not (call.scanner.ended or call.scanner.closed):
                return False
        end = self.buffer.find(self.CLOSE)
        if end < 0:  # what is left of the block before its close is dropped
            self.buffer = self.buffer[len(self.buffer) - _partial_suffix(self.buffer, self.CLOSE) :]
            return False
        found.append(call.call())
        self.buffer, self.inside, self.streamed = self.buffer[end + len(self.CLOSE) :], False, None
        return True

    def _whole(self, found: list[Segment]) -> bool:
        end = self.buffer.find(self.CLOSE, self.searched)
        if end < 0:
            self.searched = max(len(self.buffer) - len(self.CLOSE) + 1, 0)
            return False
        block = self.OPEN + self.buffer[: end + len(self.CLOSE)]
        self.buffer, self.inside = self.buffer[end + len(self.CLOSE) :], False
        found.append(self._call(block) or block)
        return True

    def _call(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block[len(self.OPEN) : -len(self.CLOSE)])
        except (ValueError, RecursionError):
            return None
        return call_of(value, self.names, ("arguments",))

    def finish(self) -> list[Segment]:
        left, self.buffer = self.buffer, ""
        if self.streamed is not None:  # cut short: the call as far as it was written
            call, self.streamed, self.inside = self.streamed.call(), None, False
            return [call]
        if self.inside:
            left, self.inside = self.OPEN + left, False
        return [left] if left else []

    @classmethod
    def call_text(cls, name: str) -> tuple[str, str]:
        return f'{cls.OPEN}{{"name": {json.dumps(name)}, "arguments": ', f"}}{cls.CLOSE}"


class Llama3JsonParser(BaseToolParser):
    """The whole output as ``{"name", "parameters"}`` objects separated by ``;``. An output that
    opens ``{"name": <a tool>, "parameters": {`` (maybe after ``<|python_tag|>``) streams its
    calls' arguments; any other output that opens like JSON is read whole at the end."""

    separator = "; "
    KEYS = ("parameters", "arguments")

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.buffer, self.is_text, self.whole = "", False, False
        self.streamed: _StreamedCall | None = None
        self.calls_made = False  # a call streamed: what follows is calls or text, never held

    def feed(self, text: str) -> list[Segment]:
        if self.is_text:
            return [text] if text else []
        self.buffer += text
        found: list[Segment] = []
        while self.buffer and not self.is_text and not self.whole:
            if self.streamed is not None:
                if not self._stream(found):
                    break
                continue
            if not self._decide(found):
                break
        if self.is_text and self.buffer:
            found.append(self.buffer)
            self.buffer = ""
        return found

    def _decide(self, found: list[Segment]) -> bool:
        head = self.buffer.lstrip()
        if self.calls_made:  # after a call: "; <the next call>", or the rest is text
            if not head or (head.startswith(";") and not head[1:].strip()):
                return False
            if not head.startswith(";"):
                self.is_text = True
                return True
            head = head[1:].lstrip()
        if not head or _begins(head, PYTHON_TAG) and len(head) < len(PYTHON_TAG):
            return False
        if not (head.startswith("{") or head.startswith(PYTHON_TAG)):
            self.is_text = True
            return True
        body = head.removeprefix(PYTHON_TAG)
        opening = read_opening(body, self.KEYS)
        if opening == PARTIAL:
            return False
        if not isinstance(opening, Opening) or opening.name not in self.names:
            if self.calls_made:
                self.is_text = True
            else:
                self.whole = True  # held to the end: calls, or text
            return True
        self.streamed = _StreamedCall(opening.name)
        found.append(self.streamed.opened())
        self.buffer = body[opening.end :]
        self.calls_made = True
        return True

    def _stream(self, found: list[Segment]) -> bool:
        call = self.streamed
        assert call is not None
        if not call.scanner.ended:
            self.buffer = self.buffer[call.take(self.buffer, found) :]
            if not call.scanner.ended:
                return False
        rest = self.buffer.lstrip()
        if not rest:
            return False
        if rest[0] == "}":  # the call's object closes: the call is whole
            found.append(call.call())
            self.buffer, self.streamed = rest[1:], None
            return True
        self.is_text = True  # not a call's end: the call stands, the rest is text
        found.append(call.call())
        self.streamed = None
        return True

    def finish(self) -> list[Segment]:
        left, self.buffer = self.buffer, ""
        if self.streamed is not None:
            found: list[Segment] = [self.streamed.call()]
            self.streamed = None
            return found + ([left] if self.is_text and left else [])
        if self.calls_made and left.strip() in ("", ";"):
            return []
        if not left or self.is_text or self.calls_made:
            return [left] if left.strip() else []
        calls = self._calls(left)
        if calls is None:
            return [left]
        leading = left[: len(left) - len(left.lstrip())]
        return [leading, *calls] if leading else calls

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
            call = call_of(value, self.names, self.KEYS)
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
    """What a piece of text turned into, in order: text to send, calls opened, their arguments'
    pieces, and calls complete (a streamed call's :class:`ToolCall` ends it: its arguments were
    sent in pieces)."""

    parts: list[Segment] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(part for part in self.parts if isinstance(part, str))

    @property
    def calls(self) -> list[ToolCall]:
        return [part for part in self.parts if isinstance(part, ToolCall)]

    def __add__(self, other: Delta) -> Delta:
        return Delta(self.parts + other.parts)


class ToolCallStream:
    """A parser's segments as :class:`Delta`s, whitespace next to a call dropped: whitespace
    that ends a text is held until more text follows it."""

    def __init__(self, parser: BaseToolParser) -> None:
        self.parser = parser
        self.held, self.after_call = "", False
        self.calls: list[ToolCall] = []
        self.streamed: set[str] = set()  # ids of the calls whose arguments were sent in pieces

    def feed(self, text: str) -> Delta:
        return self._deltas(self.parser.feed(text))

    def finish(self) -> Delta:
        delta = self._deltas(self.parser.finish())
        if self.held:
            delta.parts.append(self.held)
            self.held = ""
        return delta

    def _deltas(self, segments: list[Segment]) -> Delta:
        delta = Delta()
        for segment in segments:
            if not isinstance(segment, str):
                self.held, self.after_call = "", True
                if isinstance(segment, CallOpened):
                    self.streamed.add(segment.id)
                elif isinstance(segment, ToolCall):
                    self.calls.append(segment)
                delta.parts.append(segment)
                continue
            if self.after_call:
                segment = segment.lstrip()
                self.after_call = not segment
            text = self.held + segment
            kept = text.rstrip()
            if kept:
                delta.parts.append(kept)
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
