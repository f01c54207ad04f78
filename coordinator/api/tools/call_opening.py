"""A call read while it is written, so its arguments stream as the model writes them.

A call opens with ``{"name": "<one of the request's tools>", "arguments": {`` (``"parameters"``
for ``llama3_json``), whitespace allowed between the parts: :func:`read_opening` says whether a
text so far opens one (and where its arguments begin), may still open one, or does not. From
there the call is taken: :class:`ArgumentsScanner` passes its arguments' JSON text on piece by
piece and finds where the object ends (braces counted outside strings), or where the block that
holds it closes first (the call's arguments then end as written, cut short).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_NAME_CHARS = 64  # a tool name's limit (coordinator/api/tools/request.py)


@dataclass(frozen=True)
class CallOpened:
    """A call has begun: its id and name (its arguments follow as :class:`ArgumentsPiece`)."""

    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of the open call's arguments, as JSON text written by the model."""

    text: str


@dataclass(frozen=True)
class Opening:
    name: str
    end: int  # where the arguments' object begins


PARTIAL = "partial"  # the text may still open a call: wait for more


def read_opening(text: str, keys: tuple[str, ...]) -> Opening | str | None:
    """Whether ``text`` opens a call (an :class:`Opening`), may still open one (``PARTIAL``), or
    does not (None). ``keys``: the names its arguments may go by."""
    at: int | str | None = 0
    name = key = ""
    for part in ("{", '"name"', ":", "name", ",", "key", ":"):
        assert isinstance(at, int)
        at = _space(text, at)
        if part == "name":
            name, at = _string(text, at)
        elif part == "key":
            key, at = _string(text, at)
            if isinstance(at, int) and key not in keys:
                return None
        else:
            at = _literal(text, at, part)
        if not isinstance(at, int):
            return at
    assert isinstance(at, int)
    at = _space(text, at)
    if at == len(text):
        return PARTIAL
    return Opening(name, at) if text[at] == "{" else None


def _space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _literal(text: str, at: int, literal: str) -> int | str | None:
    """Past ``literal`` at ``at``; PARTIAL when the text ends inside it; None when it differs."""
    piece = text[at : at + len(literal)]
    if piece == literal:
        return at + len(literal)
    return PARTIAL if literal.startswith(piece) and at + len(piece) == len(text) else None


def _string(text: str, at: int) -> tuple[str, int | str | None]:
    """A JSON string at ``at``: (its value, past it); PARTIAL when unterminated so far."""
    if at == len(text):
        return "", PARTIAL
    if text[at] != '"':
        return "", None
    end = at + 1
    while end < len(text):
        if text[end] == "\\":
            end += 2
            continue
        if text[end] == '"':
            try:
                return json.loads(text[at : end + 1]), end + 1
            except ValueError:
                return "", None
        end += 1
        if end - at > 6 * MAX_NAME_CHARS:  # longer than any tool's name, escaped
            return "", None
    return "", PARTIAL


class ArgumentsScanner:
    """Follows one call's arguments object: fed text, it answers how much of it is arguments,
    whether the object ended, and whether ``close`` (the tag ending the call's block) came
    first. A piece that may begin ``close`` is held until the text after it tells."""

    def __init__(self, close: str = "") -> None:
        self.close = close
        self.depth = 0
        self.in_string = self.escaped = False
        self.ended = self.closed = False

    def scan(self, text: str) -> int:
        """How many characters of ``text`` are arguments (the rest: past the object's end or
        the close, or held); ``ended`` or ``closed`` say which stopped it."""
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                continue
            if self.close and char == self.close[0]:
                rest = text[at : at + len(self.close)]
                if rest == self.close:
                    self.closed = True
                    return at
                if self.close.startswith(rest):  # the text ends inside what may be the tag
                    return at
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ended = True
                    return at + 1
        return len(text)
