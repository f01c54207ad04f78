"""A chat answer whose text is read for tool calls (``tool_choice`` ``auto``, ``required`` or a
named function): OpenAI's shapes of :class:`~coordinator.api.openai_format.Completion`, with the
calls the model's parser (:mod:`~coordinator.api.tools.parsers`) finds in the text.

Whole: ``message = {"role": "assistant", "content": <the text outside the calls, null when
there is none>, "tool_calls": [{"id": "call_…", "type": "function", "function": {"name",
"arguments": "<JSON text>"}}]}`` (``tool_calls`` null and the content the whole text when the
model made no call). Streamed: call ``i`` opens with a chunk ``delta.tool_calls = [{"index": i,
"id", "type": "function", "function": {"name", "arguments": ""}}]`` as soon as its name is
written, and its arguments follow as the model writes them, ``[{"index": i, "function":
{"arguments": "<more JSON text>"}}]`` chunk by chunk (a call the parser reads whole sends them at
once); text outside calls is ``delta.content`` as usual, sent once it is known not to begin a
call.

``finish_reason`` is ``tool_calls`` when a call was made and the generation ended normally;
a generation cut by ``max_tokens`` stays ``length`` (a call cut short is text), a filtered one
``content_filter``. The text the content filter reads is the model's whole text, calls included;
usage, stop strings and failures are the plain answer's.
"""

from __future__ import annotations

from typing import Any

from coordinator.api.openai_format import Completion
from coordinator.api.tools.call_opening import ArgumentsPiece, CallOpened
from coordinator.api.tools.parsers import BaseToolParser, Delta, ToolCallStream, parse_tool_calls
from coordinator.content_safety import ContentFilter


class ToolCompletion(Completion):
    """A chat :class:`Completion` whose text is split into content and tool calls."""

    def __init__(
        self,
        model: str,
        num_prompt_tokens: int,
        parser: BaseToolParser,
        content_filter: ContentFilter | None = None,
    ) -> None:
        super().__init__("chat", model, num_prompt_tokens, content_filter, prompt_details=True)
        self.parser = parser
        self.calls = ToolCallStream(parser)
        self.num_opened = 0  # calls whose opening chunk was sent

    def _finish_with(self, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and self.finish == "stop" else self.finish

    def body(self) -> dict[str, Any]:
        body = super().body()
        content, calls = parse_tool_calls(self.parser, self.text)
        choice = body["choices"][0]
        if calls:
            choice["message"] = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [call.to_dict() for call in calls],
            }
        choice["finish_reason"] = self._finish_with(bool(calls))
        return body

    def piece_chunks(self, piece: str, ending: bool) -> list[bytes]:
        delta = self.calls.feed(piece) if piece else Delta()
        if ending:
            delta = delta + self.calls.finish()
        chunks: list[bytes] = []
        for part in delta.parts:
            if isinstance(part, str):
                chunks.append(self.chunk(part, None))
            elif isinstance(part, CallOpened):
                chunks.append(self._opening(part.id, part.name))
            elif isinstance(part, ArgumentsPiece):
                chunks.append(self._arguments(part.text))
            elif part.id not in self.calls.streamed:  # a call read whole: all of it at once
                chunks.append(self._opening(part.id, part.name))
                chunks.append(self._arguments(part.arguments))
        return chunks

    def _opening(self, call_id: str, name: str) -> bytes:
        self.num_opened += 1
        opened = {"name": name, "arguments": ""}
        opening = {"index": self.num_opened - 1, "id": call_id, "type": "function",
                   "function": opened}  # fmt: skip
        return self.chunk(None, None, tool_calls=[opening])

    def _arguments(self, text: str) -> bytes:
        arguments = {"index": self.num_opened - 1, "function": {"arguments": text}}
        return self.chunk(None, None, tool_calls=[arguments])

    def final_finish(self) -> str | None:
        return self._finish_with(bool(self.calls.calls))
