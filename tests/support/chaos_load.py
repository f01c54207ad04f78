"""The client side of the chaos suite: a steady load of streaming and non-streaming requests over
MindIE ``/infer``, OpenAI ``/v1/completions``, and Anthropic's ``/v1/messages`` and OpenAI's
``/v1/responses`` (the prompt as one user turn, through the chat template: the same text), each
classified as it ends. Texts are keyed by
:func:`text_key`: the prompt, and its kind's family (raw text, constrained, or chat).

With ``long_prompts``, every third request sends the next of them instead (long prompts that no
request sent before, so that the shipping defaults hand them off while they prefill the short
ones on the decode worker).

The ``openai-json`` kinds ask for a JSON schema (``response_format``): their texts are compared
with an uninterrupted constrained run's.

An outcome is ``ok`` (a normal finish; its text is compared with an uninterrupted run's),
``error`` (an honest failure: an error status with an error body, or a stream whose last event
is an error) or ``dishonest`` (anything else: a 200 with no finish, a stream that stops without
an error, a body that is not the protocol's). A request that never ends is caught by the
caller's bound on the whole load.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import httpx

from benchmarks.harness.sse import sse_lines

PROMPTS = (
    "def add(a, b):",
    "The quick brown fox",
    "import numpy as np",
    "class Stack:",
    "for i in range(10):",
    "Once upon a time",
    "SELECT * FROM",
    "hello world",
)
KINDS = (
    "openai", "openai-stream", "mindie", "mindie-stream", "openai-json", "openai-json-stream",
    "anthropic", "anthropic-stream", "responses", "responses-stream",
)  # fmt: skip
FAMILIES = ("text", "json", "chat")
MAX_TOKENS = 48
# the openai-json kinds: a schema-constrained output (its matcher replayed after a migration)
WORDS = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 8}}},
    "required": ["words"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "words", "schema": WORDS}}


def text_key(prompt: str, kind: str) -> tuple[str, str]:
    """What an outcome's text is compared by: its prompt, and its kind's family."""
    return prompt, family(kind)


def family(kind: str) -> str:
    """``json`` for schema-constrained kinds, ``chat`` for the Messages and Responses doors,
    else ``text``."""
    if constrained(kind):
        return "json"
    return "chat" if kind.startswith(("anthropic", "responses")) else "text"


def constrained(kind: str) -> bool:
    """Whether requests of ``kind`` are schema-constrained (their texts differ from the rest)."""
    return kind.startswith("openai-json")


@dataclass
class Outcome:
    kind: str
    prompt: str
    status: str  # ok, error, dishonest
    text: str = ""
    detail: str = ""
    seconds: float = 0.0
    started: float = 0.0  # time.monotonic() when it was sent

    def in_flight_during(self, start: float, end: float) -> bool:
        """Whether it was sent before ``end`` and ended after ``start``."""
        return self.started < end and self.started + self.seconds > start


@dataclass
class Load:
    """``concurrency`` clients, each sending one request after another until ``stop`` is set."""

    base_url: str
    model: str
    concurrency: int = 16
    long_prompts: Iterator[str] | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=90) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.concurrency)))

    async def _client(self, client: httpx.AsyncClient, index: int) -> None:
        n = index
        while not self.stop.is_set():
            prompt, kind = self._prompt(n), KINDS[n % len(KINDS)]
            if prompt not in PROMPTS:  # a long prompt's reference is its free text only
                kind = kind.replace("openai-json", "openai")
                kind = kind.replace("anthropic", "openai").replace("responses", "openai")
            self.outcomes.append(await request(client, self.model, kind, prompt))
            n += self.concurrency + 1  # every client goes through every (prompt, kind)

    def _prompt(self, n: int) -> str:
        if self.long_prompts is not None and n % 3 == 2:
            return next(self.long_prompts)
        return PROMPTS[n % len(PROMPTS)]


async def request(client: httpx.AsyncClient, model: str, kind: str, prompt: str) -> Outcome:
    start = time.monotonic()
    try:
        if kind.startswith("openai"):
            status, text, detail = await _openai(client, model, prompt, kind)
        elif kind.startswith("anthropic"):
            status, text, detail = await _anthropic(client, model, prompt, kind)
        elif kind.startswith("responses"):
            status, text, detail = await _responses(client, model, prompt, kind)
        else:
            status, text, detail = await _mindie(client, prompt, kind.endswith("stream"))
    except httpx.HTTPError as exc:
        status, text, detail = "dishonest", "", f"transport: {type(exc).__name__}: {exc}"
    return Outcome(kind, prompt, status, text, detail, time.monotonic() - start, start)


Reply = tuple[str, str, str]  # status, text, detail


async def _whole_or_stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    whole: Callable[[dict], Reply],
    streamed: Callable[[AsyncIterator[str]], Awaitable[Reply]],
) -> Reply:
    """POST ``body`` to ``path``; judge the JSON answer with ``whole`` or, for a stream, its SSE
    data with ``streamed``. A refusal is judged by its error body."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            return _error_body(response)
        return whole(response.json())
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return _error_body(response)
        return await streamed(_sse(response))


async def _openai(client: httpx.AsyncClient, model: str, prompt: str, kind: str) -> Reply:
    body: dict = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "stream": kind.endswith("stream")}  # fmt: skip
    if constrained(kind):
        body["response_format"] = JSON_FORMAT
    return await _whole_or_stream(client, "/v1/completions", body, _completion, _completion_stream)


def _completion(answer: dict) -> Reply:
    choice = answer["choices"][0]
    if choice["finish_reason"] not in ("length", "stop"):
        return "dishonest", choice["text"], f"finish_reason {choice['finish_reason']}"
    return "ok", choice["text"], ""


async def _completion_stream(events: AsyncIterator[str]) -> Reply:
    text, finish = "", None
    async for data in events:
        if data == "[DONE]":
            return ("ok", text, "") if finish else ("dishonest", text, "[DONE], no finish")
        chunk = json.loads(data)
        if "error" in chunk:
            return "error", text, chunk["error"]["message"]
        text += chunk["choices"][0]["text"]
        finish = chunk["choices"][0]["finish_reason"] or finish
    return "dishonest", text, "the stream ended without [DONE] or an error"


async def _anthropic(client: httpx.AsyncClient, model: str, prompt: str, kind: str) -> Reply:
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": kind.endswith("stream")}  # fmt: skip
    return await _whole_or_stream(client, "/v1/messages", body, _message, _message_stream)


def _message(message: dict) -> Reply:
    text = "".join(block["text"] for block in message["content"] if block["type"] == "text")
    if message["stop_reason"] not in ("end_turn", "max_tokens"):
        return "dishonest", text, f"stop_reason {message['stop_reason']}"
    return "ok", text, ""


async def _message_stream(events: AsyncIterator[str]) -> Reply:
    text, stop = "", None
    async for data in events:
        event = json.loads(data)
        if event["type"] == "error":
            return "error", text, event["error"]["message"]
        if event["type"] == "content_block_delta":
            text += event["delta"]["text"]
        elif event["type"] == "message_delta":
            stop = event["delta"]["stop_reason"]
        elif event["type"] == "message_stop":
            return ("ok", text, "") if stop else ("dishonest", text, "a stop without a reason")
    return "dishonest", text, "the stream ended without message_stop or an error"


async def _responses(client: httpx.AsyncClient, model: str, prompt: str, kind: str) -> Reply:
    body = {"model": model, "input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "stream": kind.endswith("stream"), "store": False}  # fmt: skip
    return await _whole_or_stream(client, "/v1/responses", body, _response, _response_stream)


def _response(answer: dict) -> Reply:
    text = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                   for part in item["content"])  # fmt: skip
    if answer["status"] not in ("completed", "incomplete"):
        return "dishonest", text, f"status {answer['status']}"
    return "ok", text, ""


async def _response_stream(events: AsyncIterator[str]) -> Reply:
    text = ""
    async for data in events:
        event = json.loads(data)
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        elif event["type"] == "response.failed":
            return "error", text, event["response"]["error"]["message"]
        elif event["type"] in ("response.completed", "response.incomplete"):
            return "ok", text, ""
    return "dishonest", text, "the stream ended without a final response event"


async def _mindie(client: httpx.AsyncClient, prompt: str, stream: bool) -> Reply:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": MAX_TOKENS}, "stream": stream}
    return await _whole_or_stream(client, "/infer", body, _infer, _infer_stream)


def _infer(answer: dict) -> Reply:
    return "ok", answer["generated_text"], ""


async def _infer_stream(events: AsyncIterator[str]) -> Reply:
    async for data in events:
        event = json.loads(data)
        if event.get("error"):
            return "error", "", event["error"]
        if "generated_text" in event:
            return "ok", event["generated_text"], ""
    return "dishonest", "", "the stream ended without a last event"


def _error_body(response: httpx.Response) -> Reply:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return "dishonest", "", f"{response.status_code} without an error body: {response.text}"
    return "error", "", f"{response.status_code}: {error}"


async def _sse(response: httpx.Response):
    async for line in sse_lines(response):
        if line.startswith("data:"):
            yield line[5:].strip()


async def reference_texts(base_url: str, model: str) -> dict[tuple[str, str], str]:
    """Each prompt's text from an undisturbed cluster at ``base_url`` in each family (every kind
    of one must agree), keyed by :func:`text_key`."""
    texts: dict[tuple[str, str], str] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for prompt in PROMPTS:
            for kind_family in FAMILIES:
                kinds = [kind for kind in KINDS if family(kind) == kind_family]
                outcomes = [await request(client, model, kind, prompt) for kind in kinds]
                assert {o.status for o in outcomes} == {"ok"}, outcomes
                assert len({o.text for o in outcomes}) == 1, outcomes
                texts[prompt, kind_family] = outcomes[0].text
            assert texts[prompt, "json"].startswith('{"words": ['), texts[prompt, "json"]
    return texts
