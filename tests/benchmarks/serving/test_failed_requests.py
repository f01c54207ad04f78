"""A failed request is kept in the records with its error text and counted: an endpoint that
answers 500, sends an error event, breaks its JSON or drops the connection, and a sender that
raises, against one that streams tokens."""

from __future__ import annotations

import asyncio
import json

import httpx

from benchmarks.harness.client import Target, run_load, send
from benchmarks.serving.metrics import SLO, RequestRecord, summarize
from benchmarks.serving.rate_sweep import flag_failures
from benchmarks.serving.workload import WorkItem


def sse(*events: object) -> bytes:
    return "".join(
        f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events
    ).encode()


def endpoint(request: httpx.Request) -> httpx.Response:
    prompt = json.loads(request.content)["inputs"]
    if prompt == "ok":
        return httpx.Response(200, content=sse({"token": "a"}, {"token": "b"}, {"token": "c"}))
    if prompt == "500":
        return httpx.Response(500, text="engine overloaded")
    if prompt == "error event":
        return httpx.Response(200, content=sse({"token": "a"}, {"error": "decode worker died"}))
    if prompt == "bad json":
        return httpx.Response(200, content=sse({"token": "a"}, "{not json"))
    raise httpx.ConnectError("connection refused", request=request)


ITEMS = [WorkItem(p, 3, "chat", 5) for p in ("ok", "500", "error event", "bad json", "drop", "ok")]


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
    assert all(r.prompt_tokens == 5 for r in records)
    summary = summarize(records, duration, SLO(ttft_s=60, tpot_s=60))
    assert summary["num_failed"] == 4 and summary["num_succeeded"] == 2
    assert summary["slo_attainment"] == 2 / 6  # failures count against the SLO
    failed = summary["failed_requests"]
    assert failed["count"] == 4 and "HTTP 500: engine overloaded" in failed["examples"]
    rows = [r.to_dict() for r in records]
    assert rows[2]["error"] == "decode worker died" and rows[2]["output_tokens"] == 1
    # a side whose runs failed requests is flagged, with examples; one that failed none is not
    flagged = flag_failures([{"summary": summary}, {"summary": summary}])
    assert flagged["failed_requests"]["count"] == 8
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
