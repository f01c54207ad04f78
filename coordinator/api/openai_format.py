"""OpenAI's answer shapes, which the Azure and MLflow doors share: ``chat.completion`` and
``text_completion`` bodies, their stream chunks, and the error body
``{"error": {"message", "type", "param", "code"}}``.

Streams are ``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``; the last content
chunk carries ``finish_reason``, and ``usage`` where the door says (``stream_usage``): on that
chunk (Azure, MLflow), or as OpenAI defines it, only when the request's
``stream_options.include_usage`` asks, in a chunk of its own with ``choices: []`` after it. A
content-filtered output is cut before the match and ends with ``finish_reason:
"content_filter"``. A request that fails after the first chunk
ends with one ``data: {"error": {"message", "type", "param", "code"}}`` chunk and the stream
closes: no ``finish_reason`` chunk, no ``[DONE]`` (the ``openai`` client raises on it).

``usage`` is ``{prompt_tokens, completion_tokens, total_tokens}``; the OpenAI and Azure doors
add ``prompt_tokens_details: {cached_tokens}`` (``prompt_details``): the prompt tokens whose KV
came from a worker's prefix cache, as the latest event with a token reports it (a migrated
request's new pair reports its own figure), never more than the prompt.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from coordinator.api.common import Events, chained
from coordinator.api.sse import sse_event
from coordinator.content_safety import ContentFilter
from coordinator.errors import ServiceError
from engine.outputs import TokenEvent, TokenLogprobs
from engine.request import FinishReason

FINISH = {  # the normal finishes; a failure is raised, never a finish (common.raising_failures)
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}
DONE = b"data: [DONE]\n\n"


def _stream_error(exc: ServiceError) -> bytes:
    """The chunk that ends a stream a service error broke."""
    error = {"message": str(exc), "type": "server_error", "param": None, "code": exc.status}
    return sse_event({"error": error})


class Completion:
    """Accumulates events into OpenAI's shapes, for chat (``kind="chat"``) or text completions."""

    # where a stream's usage goes: None, on its last choice chunk; True, in a chunk of its own
    # with ``choices: []`` after it; False, nowhere (OpenAI's door sets it from the request)
    stream_usage: bool | None = None
    # a token's text by its id, set when the request asked for log probabilities
    token_text: Callable[[int], str] | None = None

    def __init__(
        self,
        kind: str,
        model: str,
        num_prompt_tokens: int,
        content_filter: ContentFilter | None = None,
        prompt_details: bool = False,
    ) -> None:
        self.kind, self.model, self.num_prompt_tokens = kind, model, num_prompt_tokens
        self.prompt_details = prompt_details
        self.num_cached_tokens = 0
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text, self.num_tokens = "", 0
        self.finish: str | None = None
        self.content_filter = content_filter
        self.blocked = False
        self.sent = 0  # characters already streamed
        self.logprobs: list[TokenLogprobEntry] = []  # each token's, when asked
        self.logprobs_sent = 0  # of them, already streamed

    def add(self, event: TokenEvent) -> bool:
        """Take an event; a filtered output is cut before the match and ``blocked`` (True)."""
        self.text += event.text
        if event.token_id is not None:
            self.num_tokens += 1
            self.num_cached_tokens = min(event.num_cached_tokens, self.num_prompt_tokens)
            if self.token_text is not None and event.logprobs is not None:
                self.logprobs.append(logprob_entry(self.token_text, event.token_id, event.logprobs))
        if event.finish_reason is not None:
            self.finish = FINISH[event.finish_reason]
        match = self.content_filter.search(self.text) if self.content_filter else None
        if match is not None:
            self.text = self.text[: match.start()]
            self.finish, self.blocked = "content_filter", True
        return self.blocked

    def pending(self) -> str:
        """Text not streamed yet (taken)."""
        piece, self.sent = self.text[self.sent :], len(self.text)
        return piece

    @property
    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_tokens,
        }
        if self.prompt_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        if chunk and self.kind == "chat":
            obj += ".chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self) -> dict[str, Any]:
        logprobs = self._logprobs(self.logprobs)
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text, "tool_calls": None},
                "finish_reason": self.finish,
                "logprobs": logprobs,
            }
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.finish,
                      "logprobs": logprobs}  # fmt: skip
        return {**self._envelope(False), "choices": [choice], "usage": self.usage}

    def _logprobs(self, entries: list[TokenLogprobEntry]) -> dict[str, Any] | None:
        """A choice's ``logprobs`` over ``entries`` (None when the request did not ask): chat's
        ``{"content": [...], "refusal": null}``, completions' ``{"tokens", "token_logprobs",
        "top_logprobs", "text_offset"}``."""
        if self.token_text is None:
            return None
        if self.kind == "chat":
            return {"content": [entry.chat() for entry in entries], "refusal": None}
        offset = sum(len(e.token) for e in self.logprobs[: len(self.logprobs) - len(entries)])
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            # tokens of one text (two ids decoding alike) keep the likeliest's figure
            "top_logprobs": [{t: lp for t, lp in reversed(e.top)} for e in entries],
            "text_offset": offsets,
        }

    def _unsent_logprobs(self) -> dict[str, Any] | None:
        """The stream's ``logprobs`` of the tokens not sent yet (taken)."""
        entries, self.logprobs_sent = self.logprobs[self.logprobs_sent :], len(self.logprobs)
        return self._logprobs(entries)

    def chunk(
        self,
        piece: str | None,
        finish: str | None,
        role: bool = False,
        usage: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> bytes:
        logprobs = None if role else self._unsent_logprobs()
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if piece is not None:
                delta["content"] = piece
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish,
                      "logprobs": logprobs}  # fmt: skip
        payload = {**self._envelope(True), "choices": [choice]}
        if usage:
            payload["usage"] = self.usage
        return sse_event(payload)

    def piece_chunks(self, piece: str, ending: bool) -> list[bytes]:
        """The chunks of text just taken (``ending``: the last of it); a tool-call answer
        (:mod:`~coordinator.api.tools.answer`) sends calls instead of some of it."""
        return [self.chunk(piece, None)] if piece else []

    def final_finish(self) -> str | None:
        """The last chunk's ``finish_reason``."""
        return self.finish

    async def stream(self, first: TokenEvent, events: Events) -> AsyncGenerator[bytes, None]:
        """The chunks from ``first`` on; text is checked by the filter before it is sent."""
        try:
            if self.kind == "chat":
                yield self.chunk(None, None, role=True)
            async for event in chained(first, events):
                self.add(event)
                ending = event.finished or self.blocked
                for chunk in self.piece_chunks(self.pending(), ending):
                    yield chunk
                if ending:
                    last = None if self.kind == "chat" else ""
                    yield self.chunk(last, self.final_finish(), usage=self.stream_usage is None)
                    if self.stream_usage:
                        usage = {**self._envelope(True), "choices": [], "usage": self.usage}
                        yield sse_event(usage)
                    break
            yield DONE
        except ServiceError as exc:
            yield _stream_error(exc)
        finally:
            await events.aclose()


@dataclass(frozen=True)
class TokenLogprobEntry:
    """One token's log probabilities as the doors name them: by the tokens' texts."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]

    def chat(self) -> dict[str, Any]:
        """Chat's ``{"token", "logprob", "bytes", "top_logprobs"}``."""
        top = [_named(token, logprob) for token, logprob in self.top]
        return {**_named(self.token, self.logprob), "top_logprobs": top}


def _named(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": _utf8(token)}


@functools.lru_cache(maxsize=65536)
def _utf8(token: str) -> list[int]:
    """A token text's UTF-8 bytes (one list a text, shared: it is only ever serialized)."""
    return list(token.encode())


def logprob_entry(token_text: Callable[[int], str], token_id: int, logprobs: TokenLogprobs):
    top = tuple((token_text(i), lp) for i, lp in logprobs.top)
    return TokenLogprobEntry(token_text(token_id), logprobs.logprob, top)
