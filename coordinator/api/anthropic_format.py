"""Anthropic's answer shapes for ``POST /v1/messages``: the ``message`` body, its stream of named
events, and the error body ``{"type": "error", "error": {"type", "message"}}``.

Whole: ``{id: "msg_…", type: "message", role: "assistant", model, content: [blocks],
stop_reason, stop_sequence, usage}``. ``content`` is a ``text`` block for the text outside tool
calls (none when there is no text) and a ``tool_use`` block ``{id: "toolu_…", name, input}`` for
each call the model's parser read (:mod:`~coordinator.api.tools.parsers`). ``stop_reason``:
``end_turn`` (the model ended, or its grammar completed), ``stop_sequence`` (with
``stop_sequence`` the one matched), ``max_tokens``, ``tool_use`` (a call was made and the turn
ended normally) or ``refusal`` (the content filter cut the output). ``usage``: ``input_tokens``
computed, ``cache_read_input_tokens`` read from a worker's prefix cache,
``cache_creation_input_tokens`` 0 (caching is automatic and costs nothing to write),
``output_tokens``.

Streamed (``event: <type>\\ndata: {json}\\n\\n``): ``message_start`` (the message with empty
content and the input usage), ``ping``, then for each block ``content_block_start``,
``content_block_delta`` (``text_delta``, or ``input_json_delta`` with the call's arguments as
they are written), ``content_block_stop``; then ``message_delta`` (``stop_reason``,
``stop_sequence``, ``usage.output_tokens``) and ``message_stop``. A request that fails after
the stream began ends with one ``event: error`` (``{"type": "error", "error": {"type":
"api_error", …}}``): no ``message_delta``, no ``message_stop``, never a normal end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse

from coordinator.api.common import Events
from coordinator.api.errors import APIError, retry_headers
from coordinator.api.sse import named_event
from coordinator.api.tools.call_opening import ArgumentsPiece, CallOpened
from coordinator.api.tools.parsers import (
    BaseToolParser,
    Delta,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
)
from coordinator.content_safety import ContentFilter
from coordinator.errors import ServiceError
from engine.outputs import TokenEvent
from engine.request import FinishReason

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {FinishReason.EOS: "end_turn", FinishReason.LENGTH: "max_tokens"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError) -> JSONResponse:
    """Anthropic's error body for a refused or failed request, with its status."""
    body = error_body(error.status, error.message)
    return JSONResponse(body, status_code=error.status, headers=retry_headers(error))


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessageAnswer:
    """Accumulates a generation's events into a Messages answer (``parser``: the tool-call
    parser when the request offers tools, else None)."""

    def __init__(
        self,
        model: str,
        num_prompt_tokens: int,
        tokenizer: Any,
        stop_sequences: tuple[str, ...] = (),
        parser: BaseToolParser | None = None,
        content_filter: ContentFilter | None = None,
    ) -> None:
        self.model, self.num_prompt_tokens, self.tokenizer = model, num_prompt_tokens, tokenizer
        self.stop_sequences, self.parser = stop_sequences, parser
        self.content_filter = content_filter
        self.id = f"msg_{uuid.uuid4().hex}"
        self.text, self.sent = "", 0
        self.output_ids: list[int] = []
        self.num_cached_tokens = 0
        self.finish: FinishReason | None = None
        self.blocked = False
        self.calls = ToolCallStream(parser) if parser is not None else None
        self.warm_only = False  # max_tokens 0: the output is not sent

    # ---- accumulating ------------------------------------------------------------------------

    def add(self, event: TokenEvent) -> bool:
        """Take an event; a filtered output is cut before the match and ``blocked`` (True)."""
        if event.finish_reason is not None:
            self.finish = event.finish_reason
        if self.warm_only:
            self.num_cached_tokens = min(event.num_cached_tokens, self.num_prompt_tokens)
            return False
        self.text += event.text
        if event.token_id is not None:
            self.output_ids.append(event.token_id)
            self.num_cached_tokens = min(event.num_cached_tokens, self.num_prompt_tokens)
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self.text, self.blocked = self.text[: match.start()], True
        return self.blocked

    def stop(self, made_calls: bool) -> tuple[str | None, str | None]:
        """``(stop_reason, stop_sequence)`` of the finished answer."""
        if self.blocked:
            return "refusal", None
        if self.warm_only:
            return "max_tokens", None
        if self.finish == FinishReason.STOP:
            matched = self._matched_stop()
            if matched is not None:
                return "stop_sequence", matched
        reason = STOP_REASONS.get(self.finish, "end_turn") if self.finish else None
        if made_calls and reason == "end_turn":
            return "tool_use", None
        return reason, None

    def _matched_stop(self) -> str | None:
        """The stop sequence that ended the output: the one the whole output's text holds where
        the answer's text (cut before it) ends."""
        if not self.stop_sequences:
            return None
        whole = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        rest = whole[len(self.text) :] if whole.startswith(self.text) else whole
        found = [(rest.find(s), s) for s in self.stop_sequences if s in rest]
        return min(found)[1] if found else None

    def usage(self) -> dict[str, int]:
        return {
            "input_tokens": self.num_prompt_tokens - self.num_cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.num_cached_tokens,
            "output_tokens": len(self.output_ids),
        }

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]):
        reason, sequence = stop
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self.usage(),
        }

    # ---- whole -------------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        text, calls = self.text, list[ToolCall]()
        if self.parser is not None:
            text, calls = parse_tool_calls(self.parser, self.text)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        content += [_tool_use_block(call) for call in calls]
        return self._message(content, self.stop(bool(calls)))

    # ---- streamed ----------------------------------------------------------------------------

    async def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        blocks = _Blocks()
        try:
            self.add(first)
            start = self._message([], (None, None))
            start["usage"]["output_tokens"] = len(self.output_ids)
            yield named_event("message_start", {"type": "message_start", "message": start})
            yield named_event("ping", {"type": "ping"})
            for chunk in self._deltas(blocks, first.finished or self.blocked):
                yield chunk
            if not (first.finished or self.blocked):
                async for later in events:
                    self.add(later)
                    ending = later.finished or self.blocked
                    for chunk in self._deltas(blocks, ending):
                        yield chunk
                    if ending:
                        break
            for chunk in blocks.close():
                yield chunk
            reason, sequence = self.stop(blocks.made_calls)
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            usage = {"output_tokens": len(self.output_ids)}
            closing = {"type": "message_delta", "delta": delta, "usage": usage}
            yield named_event("message_delta", closing)
            yield named_event("message_stop", {"type": "message_stop"})
        except ServiceError as exc:
            yield named_event("error", error_body(exc.status, str(exc)))
        finally:
            await events.aclose()

    def _deltas(self, blocks: _Blocks, ending: bool) -> list[bytes]:
        piece, self.sent = self.text[self.sent :], len(self.text)
        if self.calls is None:
            return blocks.text(piece)
        delta = self.calls.feed(piece) if piece else Delta()
        if ending:
            delta = delta + self.calls.finish()
        chunks: list[bytes] = []
        for part in delta.parts:
            if isinstance(part, str):
                chunks += blocks.text(part)
            elif isinstance(part, CallOpened):
                chunks += blocks.open_call(part.id, part.name)
            elif isinstance(part, ArgumentsPiece):
                chunks += blocks.arguments(part.text)
            else:
                if part.id not in self.calls.streamed:  # read whole: all of it at once
                    chunks += blocks.open_call(part.id, part.name)
                    chunks += blocks.arguments(part.arguments)
                chunks += blocks.close_call()
        return chunks


class _Blocks:
    """The content blocks of a streamed message: one text block open at a time, each call a
    block of its own."""

    def __init__(self) -> None:
        self.count = 0
        self.open_text = False
        self.made_calls = False

    def text(self, piece: str) -> list[bytes]:
        if not piece:
            return []
        chunks = []
        if not self.open_text:
            start = {"type": "content_block_start", "index": self.count,
                     "content_block": {"type": "text", "text": ""}}  # fmt: skip
            chunks.append(named_event("content_block_start", start))
            self.open_text = True
        delta = {"type": "content_block_delta", "index": self.count,
                 "delta": {"type": "text_delta", "text": piece}}  # fmt: skip
        chunks.append(named_event("content_block_delta", delta))
        return chunks

    def open_call(self, call_id: str, name: str) -> list[bytes]:
        chunks = self.close()
        self.made_calls = True
        opened = {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}}
        start = {"type": "content_block_start", "index": self.count, "content_block": opened}
        return [*chunks, named_event("content_block_start", start)]

    def arguments(self, text: str) -> list[bytes]:
        if not text:
            return []
        arguments = {"type": "input_json_delta", "partial_json": text}
        delta = {"type": "content_block_delta", "index": self.count, "delta": arguments}
        return [named_event("content_block_delta", delta)]

    def close_call(self) -> list[bytes]:
        stop = {"type": "content_block_stop", "index": self.count}
        self.count += 1
        return [named_event("content_block_stop", stop)]

    def close(self) -> list[bytes]:
        """Close the open text block, if any."""
        if not self.open_text:
            return []
        self.open_text = False
        stop = {"type": "content_block_stop", "index": self.count}
        self.count += 1
        return [named_event("content_block_stop", stop)]


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # cut short by max_tokens (or not JSON as written): no input read
        arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments}
