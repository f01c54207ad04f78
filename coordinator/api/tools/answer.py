"""A chat answer whose text is read for tool calls (``tool_choice`` ``auto``, ``required`` or a
named function): OpenAI's shapes of :class:`~coordinator.api.openai_format.Completion`, with the
calls the model's parser (:mod:`~coordinator.api.tools.parsers`) finds in the text.

Whole: ``message = {"role": "assistant", "content": <the text outside the calls, null when
there is none>, "tool_calls": [{"id": "call_…", "type": "function", "function": {"name",
"arguments": "<JSON text>"}}]}`` (``tool_calls`` null and the content the whole text when the
model made no call). Streamed: call ``i`` opens with a chunk ``delta.tool_calls = [{"index": i,
"id", "type": "function", "function": {"name", "arguments": ""}}]`` and its arguments follow as
``[{"index": i, "function": {"arguments": "<JSON text>"}}]``; text outside calls is
``delta.content`` as usual, sent once it is known not to begin a call.

``finish_reason`` is ``tool_calls`` when a call was made and the generation ended normally;
a generation cut by ``max_tokens`` stays ``length`` (a call cut short is text), a filtered one
``content_filter``. The text the content filter reads is the model's whole text, calls included;
usage, stop strings and failures are the plain answer's.
"""

from __future__ import annotations

from typing import Any

from coordinator.api.openai_format import Completion
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
            last = self.calls.finish()
            delta = Delta(delta.text + last.text, delta.calls + last.calls)
        chunks = [self.chunk(delta.text, None)] if delta.text else []
        first_index = len(self.calls.calls) - len(delta.calls)
        for index, call in enumerate(delta.calls, start=first_index):
            opened = {"name": call.name, "arguments": ""}
            opening = {"index": index, "id": call.id, "type": "function", "function": opened}
            arguments = {"index": index, "function": {"arguments": call.arguments}}
            chunks.append(self.chunk(None, None, tool_calls=[opening]))
            chunks.append(self.chunk(None, None, tool_calls=[arguments]))
        return chunks

    def final_finish(self) -> str | None:
        return self._finish_with(bool(self.calls.calls))
