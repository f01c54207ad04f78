"""Streaming clients and the load generator of the serving benchmark.

Targets: pdserve's ``POST /infer`` (SSE, one event per token), TGI's ``POST /generate_stream``
(the same token events, ``data:`` without a space), any OpenAI-compatible ``/v1/completions`` or
``/v1/chat/completions``, or Azure AI Model Inference's ``/chat/completions`` (``stream: true``;
the output token count comes from the final ``usage`` when the server sends one, else from the
content chunks). Requests ask for exactly ``output_tokens`` tokens (``ignore_eos``, which
pdserve, vLLM and llama.cpp honour; Azure's passed through with ``extra-parameters:
pass-through``); TGI's API has no such parameter, so its answers may end at the end-of-sequence
token (the tokens counted are those streamed).
A chat request sends the item's prompt as one user message, or a whole conversation
(``messages``); ``on_event`` sees every parsed event (answer text, usage).

A request that fails (an HTTP status other than 200, an error event, a broken connection, a body
that is not SSE JSON, an exception of ``send_one``) is kept in the records with its error text,
never dropped: the summaries count it against the run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from benchmarks.harness.record import RequestRecord
from benchmarks.harness.sse import sse_lines
from benchmarks.serving.workload import WorkItem

APIS = ("infer", "completions", "chat", "tgi", "azure")
AZURE_API_VERSION = "2024-05-01-preview"
TOKEN_EVENTS = ("infer", "tgi")  # one event per token, the last with ``generated_text``
CHAT_CHUNKS = ("chat", "azure")


@dataclass(frozen=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:1025
    api: str = "infer"
    model: str = ""  # the OpenAI "model" field
    ignore_eos: bool = True
    headers: tuple[tuple[str, str], ...] = ()

    def request_headers(self) -> dict[str, str]:
        """The target's own headers; Azure's ``extra-parameters`` lets ``ignore_eos`` through."""
        extra = {"extra-parameters": "pass-through"} if self.api == "azure" else {}
        return {**extra, **dict(self.headers)}

    def request(self, item: WorkItem, messages: list[dict] | None = None) -> tuple[str, dict]:
        if self.api == "infer":
            parameters = {"max_new_tokens": item.output_tokens, "ignore_eos": self.ignore_eos}
            return "/infer", {"inputs": item.prompt, "stream": True, "parameters": parameters}
        if self.api == "tgi":  # greedy by default; no ignore_eos in TGI's parameters
            parameters = {"max_new_tokens": item.output_tokens}
            return "/generate_stream", {"inputs": item.prompt, "parameters": parameters}
        body = {
            "model": self.model,
            "max_tokens": item.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api in CHAT_CHUNKS:
            body["messages"] = messages or [{"role": "user", "content": item.prompt}]
            if self.api == "azure":
                return f"/chat/completions?api-version={AZURE_API_VERSION}", body
            return "/v1/chat/completions", body
        return "/v1/completions", {**body, "prompt": item.prompt}


@dataclass
class _Timing:
    """Where a streamed request stands: its start, last token, usage count, textless finish."""

    start: float
    last: float
    usage_tokens: int | None = None
    finished_at: float = 0.0


async def send(
    client: httpx.AsyncClient,
    target: Target,
    item: WorkItem,
    messages: list[dict] | None = None,
    on_event: Callable[[dict], None] | None = None,
    extra_body: dict | None = None,
    record: RequestRecord | None = None,
) -> RequestRecord:
    """One streamed request, timed token by token; ``extra_body``: more fields of its body;
    ``record``: the caller's to fill in (what arrived is there if the request is cancelled). A
    failure ends it with ``record.error`` set (what came before it is kept)."""
    record = record or RequestRecord(item.prompt_tokens, item.output_tokens)
    path, body = target.request(item, messages)
    body, headers = {**body, **(extra_body or {})}, target.request_headers()
    start = time.perf_counter()
    timing = _Timing(start, start)
    try:
        async with client.stream("POST", target.url + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            await _read_events(response, target.api, record, timing, on_event)
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # transport, bad JSON
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.e2e_s = timing.last - timing.start
    if record.error is None and record.finish_reason is None:
        record.error = f"the stream ended after {record.output_tokens} tokens without a finish"
    elif record.error is None and record.ttft_s is None:
        # every token's text held back (bytes of a character): seen at the end
        if timing.usage_tokens:
            record.ttft_s = timing.finished_at
        else:
            record.error = f"finished ({record.finish_reason}) without a token"
    if timing.usage_tokens is not None and record.error is None:
        record.output_tokens = timing.usage_tokens
    return record


async def _read_events(
    response: httpx.Response,
    api: str,
    record: RequestRecord,
    timing: _Timing,
    on_event: Callable[[dict], None] | None,
) -> None:
    """The stream's events onto ``record``, each token timed as it arrives, up to an error."""
    async for line in sse_lines(response):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if on_event is not None:
            on_event(event)
        if "error" in event:
            record.error = str(event["error"])
            break
        timing.usage_tokens = _read_usage(event, record, timing.usage_tokens)
        record.finish_reason = _finish_reason(event, api) or record.finish_reason
        if not carries_token(event, api):
            if record.finish_reason and record.ttft_s is None:  # tokens with no text
                timing.finished_at = time.perf_counter() - timing.start
            continue
        now = time.perf_counter()
        if record.ttft_s is None:
            record.ttft_s = now - timing.start
        else:
            record.gaps_s.append(now - timing.last)
        timing.last = now
        record.output_tokens += 1


def _read_usage(event: dict, record: RequestRecord, tokens: int | None) -> int | None:
    """The usage's completion tokens (else ``tokens``); its prompt and cached tokens (OpenAI's
    usage, or llama.cpp's timings) go on ``record``."""
    cached = (event.get("timings") or {}).get("cache_n")  # llama.cpp's own figure
    if cached is not None:
        record.cached_tokens = cached
    usage = event.get("usage") or {}
    if not usage:
        return tokens
    record.served_prompt_tokens = usage.get("prompt_tokens", record.served_prompt_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        record.cached_tokens = cached
    return usage.get("completion_tokens", tokens)


def _finish_reason(event: dict, api: str) -> str | None:
    """How the answer ended, from its last event: MindIE's carries ``generated_text`` (and its
    details a finish reason); an OpenAI chunk a choice's ``finish_reason``."""
    if api in TOKEN_EVENTS:
        if event.get("generated_text") is None:
            return None
        return (event.get("details") or {}).get("finish_reason") or "final event"
    choices = event.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def carries_token(event: dict, api: str) -> bool:
    """Whether a parsed event of ``api`` brings a token of the answer."""
    if api in TOKEN_EVENTS:
        return "token" in event
    choices = event.get("choices") or []
    if not choices:
        return False
    if api in CHAT_CHUNKS:  # the first chunk may carry the role alone
        return bool((choices[0].get("delta") or {}).get("content"))
    # a token's chunk may have empty text (a byte of a character not yet complete); the closing
    # chunk has empty text and the finish reason
    text = choices[0].get("text")
    return text is not None and bool(text or not choices[0].get("finish_reason"))
