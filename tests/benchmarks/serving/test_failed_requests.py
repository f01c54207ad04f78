"""A failed request is kept in the records with its error text and counted: an endpoint that
answers 500, sends an error event, breaks its JSON, drops the connection or stops without its
final event, and a sender that raises, against one that streams tokens to a normal finish."""

from __future__ import annotations

import asyncio
import json

import httpx

from benchmarks.harness.client import Target, send
from benchmarks.harness.load import run_load
from benchmarks.harness.record import RequestRecord
from benchmarks.serving.metrics import SLO, summarize
from benchmarks.serving.rate_sweep import flag_failures
from benchmarks.serving.workload import WorkItem


def sse(*events: object) -> bytes:
    return "".join(
        f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events
    ).encode()


def endpoint(request: httpx.Request) -> httpx.Response:
    prompt = json.loads(request.content)["inputs"]
    if prompt == "ok":
        last = {"token": {"id": 3, "text": None}, "generated_text": "abc", "details": None}
        return httpx.Response(200, content=sse({"token": "a"}, {"token": "b"}, last))
    if prompt == "no end":
        return httpx.Response(200, content=sse({"token": "a"}, {"token": "b"}, {"token": "c"}))
    if prompt == "500":
        return httpx.Response(500, text="engine overloaded")
    if prompt == "error event":
        return httpx.Response(200, content=sse({"token": "a"}, {"error": "decode worker died"}))
    if prompt == "bad json":
        return httpx.Response(200, content=sse({"token": "a"}, "{not json"))
    raise httpx.ConnectError("connection refused", request=request)


PROMPTS = ("ok", "500", "error event", "bad json", "drop", "no end", "ok")
ITEMS = [WorkItem(p, 3, "chat", 5) for p in PROMPTS]


def run(send_one=None) -> tuple[list[RequestRecord], float]:
    async def go():
        transport = httpx.MockTransport(endpoint)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            target = Target("http://test")
            one = send_one or (lambda item: send(client, target, item))
            return await run_load(ITEMS, one, request_rate=None)

    return asyncio.run(go())


def test_every_failed_request_is_kept_with_its_error_and_counted():
    records, duration = run()
    assert len(records) == len(ITEMS)  # none dropped, in order
    ok = [r for r in records if r.ok]
    assert len(ok) == 2 and all(r.output_tokens == 3 and r.error is None for r in ok)
    errors = [r.error for r in records]
    assert errors[1] == "HTTP 500: engine overloaded"
    assert errors[2] == "decode worker died"
    assert errors[3].startswith("JSONDecodeError")
    assert errors[4].startswith("ConnectError: connection refused")
    assert errors[5] == "the stream ended after 3 tokens without a finish"  # never a finish
    assert all(r.prompt_tokens == 5 for r in records)
    assert [r.finish_reason for r in ok] == ["final event"] * 2
    summary = summarize(records, duration, SLO(ttft_s=60, tpot_s=60))
    assert summary["num_failed"] == 5 and summary["num_succeeded"] == 2
    assert summary["slo_attainment"] == 2 / 7  # failures count against the SLO
    failed = summary["failed_requests"]
    assert failed["count"] == 5 and "HTTP 500: engine overloaded" in failed["examples"]
    rows = [r.to_dict() for r in records]
    assert rows[2]["error"] == "decode worker died" and rows[2]["output_tokens"] == 1
    # a side whose runs failed requests is flagged, with examples; one that failed none is not
    flagged = flag_failures([{"summary": summary}, {"summary": summary}])
    assert flagged["failed_requests"]["count"] == 10
    assert "decode worker died" in flagged["failed_requests"]["examples"]
    clean = summarize([r for r in records if r.ok], duration, SLO())
    assert clean["failed_requests"] is None and flag_failures([{"summary": clean}]) == {}


def test_a_sender_that_raises_leaves_a_failed_record_not_a_hole():
    async def flaky(item: WorkItem) -> RequestRecord:
        if item.prompt == "drop":
            raise RuntimeError("client bug")
        return RequestRecord(item.prompt_tokens, item.output_tokens, ttft_s=0.1, e2e_s=0.2,
                             output_tokens=2)  # fmt: skip

    records, _ = run(flaky)
    assert len(records) == len(ITEMS)
    assert [r.error for r in records].count("RuntimeError: client bug") == 1
    assert sum(not r.ok for r in records) == 1


def _openai(request: httpx.Request) -> httpx.Response:
    """An OpenAI-compatible stream: two chunks, the finish, the usage (with cached tokens, or
    llama.cpp's timings), [DONE]; or, for "cut", the chunks alone."""
    prompt = json.loads(request.content)["prompt"]
    chunks = [{"choices": [{"text": t, "finish_reason": None}]} for t in ("a", "b")]
    if prompt == "cut":
        return httpx.Response(200, content=sse(*chunks, "[DONE]"))
    finish = {"choices": [{"text": "", "finish_reason": "length"}]}
    usage: dict = {"prompt_tokens": 9, "completion_tokens": 2}
    if prompt == "cached":
        usage["prompt_tokens_details"] = {"cached_tokens": 7}
    extra = {"timings": {"cache_n": 5}} if prompt == "llama" else {}
    return httpx.Response(200, content=sse(*chunks, finish, {"usage": usage, **extra}, "[DONE]"))


def test_an_openai_stream_records_its_finish_and_the_usage_cached_tokens():
    async def go(prompt: str) -> RequestRecord:
        transport = httpx.MockTransport(_openai)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            target = Target("http://test", api="completions")
            return await send(client, target, WorkItem(prompt, 2, "chat", 9))

    cached, llama, plain, cut = (asyncio.run(go(p)) for p in ("cached", "llama", "plain", "cut"))
    assert cached.ok and cached.finish_reason == "length" and cached.output_tokens == 2
    assert (cached.served_prompt_tokens, cached.cached_tokens) == (9, 7)
    assert llama.cached_tokens == 5 and plain.ok and plain.cached_tokens is None
    assert not cut.ok and cut.error == "the stream ended after 2 tokens without a finish"
