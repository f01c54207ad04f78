"""The Responses API's answer: the ``response`` object and its event stream.

``output`` holds a ``message`` item (``{id: "msg_…", type: "message", role: "assistant",
status, content: [{type: "output_text", text, annotations: [], logprobs}]}``) for the text
outside tool calls and a ``function_call`` item (``{id: "fc_…", type: "function_call",
call_id: "call_…", name, arguments, status}``) for each call the model's parser read
(:mod:`~coordinator.api.tools.parsers`), in the order they were written. ``status``:
``completed``; ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` or
``content_filter``. ``usage``: ``input_tokens`` (with ``input_tokens_details.cached_tokens``
from a worker's prefix cache), ``output_tokens``, ``total_tokens``.

Streamed (``event: <type>`` then ``data: {json}``, every event with its ``sequence_number``):
``response.created`` and ``response.in_progress``; for a message ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (with the tokens' log
probabilities when asked), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``; for a call ``response.output_item.added``,
``response.function_call_arguments.delta`` as the arguments are written,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete``). A request that fails after the stream began
ends with ``response.failed`` (the response with ``status: failed`` and ``error``): never a
normal end.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from coordinator.api.common import Events
from coordinator.api.openai_format import TokenLogprobEntry, logprob_entry
from coordinator.api.sse import dumps, named_event
from coordinator.api.tools.call_opening import ArgumentsPiece, CallOpened
from coordinator.api.tools.parsers import BaseToolParser, Segment, ToolCall, ToolCallStream
from coordinator.content_safety import ContentFilter
from coordinator.errors import ServiceError
from engine.outputs import TokenEvent
from engine.request import FinishReason


class ResponseAnswer:
    """Accumulates a generation's events into a ``response``; ``echo``: the request's own
    fields the response repeats (``model``, ``tools``, ``instructions``, …)."""

    def __init__(
        self,
        echo: dict[str, Any],
        num_prompt_tokens: int,
        parser: BaseToolParser | None = None,
        content_filter: ContentFilter | None = None,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.echo, self.num_prompt_tokens = echo, num_prompt_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.calls = ToolCallStream(parser) if parser is not None else None
        self.content_filter, self.token_text = content_filter, token_text
        self.text, self.sent, self.num_tokens, self.num_cached_tokens = "", 0, 0, 0
        self.finish: FinishReason | None = None
        self.blocked = False
        self.logprobs: list[TokenLogprobEntry] = []
        self.logprobs_sent = 0
        self.output: list[dict[str, Any]] = []  # the items, built as the text is read
        # a finished response to keep: awaited before a stream's last event; a whole answer's
        # (``final``, set by ``body``) is kept by its route before it is sent
        self.on_done: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self.final: dict[str, Any] | None = None

    # ---- accumulating ------------------------------------------------------------------------

    def add(self, event: TokenEvent) -> bool:
        self.text += event.text
        if event.token_id is not None:
            self.num_tokens += 1
            self.num_cached_tokens = min(event.num_cached_tokens, self.num_prompt_tokens)
            if self.token_text is not None and event.logprobs is not None:
                self.logprobs.append(logprob_entry(self.token_text, event.token_id,
                                                   event.logprobs))  # fmt: skip
        if event.finish_reason is not None:
            self.finish = event.finish_reason
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self.text, self.blocked = self.text[: match.start()], True
        return self.blocked

    def _parts(self, ending: bool) -> list[Segment]:
        """What the text not read yet turned into (all of it when ``ending``)."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        if self.calls is None:
            return [piece] if piece else []
        parts = self.calls.feed(piece).parts if piece else []
        return parts + self.calls.finish().parts if ending else parts

    @property
    def status(self) -> str:
        return "incomplete" if self.blocked or self.finish == FinishReason.LENGTH else "completed"

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = None
        if status == "incomplete":
            reason = "content_filter" if self.blocked else "max_output_tokens"
            incomplete = {"reason": reason}
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": self.output if status != "in_progress" else [],
            "usage": self._usage() if done else None,
            "reasoning": {"effort": None, "summary": None},
            **self.echo,
        }

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.num_cached_tokens,
                "cache_write_tokens": 0,
            },  # fmt: skip
            "output_tokens": self.num_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.num_prompt_tokens + self.num_tokens,
        }

    # ---- whole -------------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        items = _Items(self)
        for part in self._parts(ending=True):
            items.take(part)
        items.close()
        self.final = self.response(self.status)
        return self.final

    # ---- streamed ----------------------------------------------------------------------------

    async def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        items = _Items(self)
        try:
            yield items.event("response.created", response=self.response("in_progress"))
            yield items.event("response.in_progress", response=self.response("in_progress"))
            event_now: TokenEvent | None = first
            while event_now is not None:
                self.add(event_now)
                ending = event_now.finished or self.blocked
                for part in self._parts(ending):
                    for chunk in items.take(part):
                        yield chunk
                if ending:
                    break
                event_now = await anext(events, None)
            for chunk in items.close():
                yield chunk
            response = self.response(self.status)
            if self.on_done is not None:
                await self.on_done(response)
            yield items.event(f"response.{self.status}", response=response)
        except ServiceError as exc:
            error = {"code": "server_error", "message": str(exc)}
            yield items.event("response.failed", response=self.response("failed", error))
        finally:
            await events.aclose()


class _Items:
    """The output items as they are read: one message item open at a time, each call an item
    of its own; each step answers the stream's events (the whole answer ignores them)."""

    def __init__(self, answer: ResponseAnswer) -> None:
        self.answer, self.sequence = answer, 0
        self.message: dict[str, Any] | None = None
        self.texts: list[str] = []  # the open message's text, piece by piece
        self.delta_head = self.delta_ids = b""
        self.call: dict[str, Any] | None = None

    def event(self, kind: str, **payload: Any) -> bytes:
        self.sequence += 1
        return named_event(kind, {"type": kind, "sequence_number": self.sequence - 1, **payload})

    def take(self, part: Segment) -> list[bytes]:
        if isinstance(part, str):
            return self._text(part)
        if isinstance(part, CallOpened):
            return [*self._close_message(), *self._open_call(part.id, part.name)]
        if isinstance(part, ArgumentsPiece):
            return self._arguments(part.text)
        if self.call is None:  # a call read whole: all of it at once
            chunks = [*self._close_message(), *self._open_call(part.id, part.name)]
            return [*chunks, *self._arguments(part.arguments), *self._close_call(part)]
        return self._close_call(part)

    def close(self) -> list[bytes]:
        return self._close_message()

    def _text(self, text: str) -> list[bytes]:
        chunks = []
        if self.message is None:
            chunks += self._open_message()
        self.texts.append(text)
        logprobs = self._logprobs()
        if logprobs is not None:
            self.message["content"][0]["logprobs"].extend(logprobs)  # type: ignore[index]
        # the delta's event, its fixed parts encoded once a message (the most frequent event)
        self.sequence += 1
        number = str(self.sequence - 1).encode()
        tail = b',"logprobs":' + dumps(logprobs or []) + b"}\n\n"
        chunks.append(self.delta_head + number + self.delta_ids + dumps(text) + tail)
        return chunks

    def _open_message(self) -> list[bytes]:
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "content": [],
                        "status": "in_progress", "role": "assistant"}  # fmt: skip
        self.texts = []
        index = len(self.answer.output)
        self.answer.output.append(self.message)
        item_id = self.message["id"]
        added = self.event("response.output_item.added", output_index=index,
                           item={**self.message, "content": []})  # fmt: skip
        part = self._part("")
        part_added = self.event("response.content_part.added", item_id=item_id,
                                output_index=index, content_index=0, part=part)  # fmt: skip
        self.message["content"].append(part)
        name = "response.output_text.delta"
        self.delta_head = f'event: {name}\ndata: {{"type":"{name}","sequence_number":'.encode()
        self.delta_ids = (f',"item_id":"{item_id}","output_index":{index},"content_index":0,'
                          '"delta":').encode()  # fmt: skip
        return [added, part_added]

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.answer.token_text is not None:
            part["logprobs"] = []
        return part

    def _logprobs(self) -> list[dict[str, Any]] | None:
        answer = self.answer
        if answer.token_text is None:
            return None
        entries = answer.logprobs[answer.logprobs_sent :]
        answer.logprobs_sent = len(answer.logprobs)
        return [entry.chat() for entry in entries]

    def _close_message(self) -> list[bytes]:
        message, self.message = self.message, None
        if message is None:
            return []
        message["status"] = "incomplete" if self.answer.status == "incomplete" else "completed"
        index, part = self._index(message), message["content"][0]
        part["text"] = "".join(self.texts)
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.event(
                "response.output_text.done",
                **ids,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            ),  # fmt: skip
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=index, item=message),
        ]

    def _open_call(self, call_id: str, name: str) -> list[bytes]:
        self.call = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status":
                     "in_progress", "call_id": call_id, "name": name, "arguments": ""}  # fmt: skip
        index = len(self.answer.output)
        self.answer.output.append(self.call)
        return [self.event("response.output_item.added", output_index=index, item=dict(self.call))]

    def _arguments(self, text: str) -> list[bytes]:
        assert self.call is not None
        self.call["arguments"] += text
        return [self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                           output_index=self._index(self.call), delta=text)]  # fmt: skip

    def _close_call(self, call: ToolCall) -> list[bytes]:
        item, self.call = self.call, None
        assert item is not None
        item["arguments"], item["status"] = call.arguments, "completed"
        index = self._index(item)
        return [
            self.event("response.function_call_arguments.done", item_id=item["id"],
                       output_index=index, name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, x in enumerate(self.answer.output) if x is item)
