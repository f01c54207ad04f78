"""Sends one soak ``Plan`` and sorts what came back by cause.

Causes: ``ok``; the expected refusals ``invalid_4xx`` (a body the server had to refuse),
``timeout_408`` (a request whose own ``timeout`` expired), ``too_many_429``; ``client_aborted``
(the client closed the stream or stopped waiting before the end, as planned); and
``unexpected``: any 5xx, a stream whose last event is an error or that stops without its final
event, a valid request refused, an invalid one accepted, a transport error or no answer in time.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

from benchmarks.harness.sse import sse_lines
from tests.soak.requests import Plan

CAUSES = ("ok", "invalid_4xx", "timeout_408", "too_many_429", "client_aborted", "unexpected")


@dataclass
class Outcome:
    cause: str
    status: int | None = None  # HTTP status, None when no answer came
    detail: str = ""  # why, for unexpected outcomes


@dataclass
class StreamRead:
    """What the client saw of an SSE answer."""

    events: int = 0
    finished: bool = False  # the door's final event (or ``[DONE]``) arrived
    error: object = None  # the payload of an error event
    closed_early: bool = False  # the client closed it on purpose


async def send_plan(client: httpx.AsyncClient, base_url: str, plan: Plan) -> Outcome:
    """Send ``plan`` and classify the answer (never raises, except on cancellation)."""
    url = base_url + plan.path
    content = plan.body if isinstance(plan.body, bytes) else json.dumps(plan.body).encode()
    headers = {"content-type": "application/json"}
    try:
        if plan.stream:
            return await _send_stream(client, url, content, headers, plan)
        request = client.post(url, content=content, headers=headers)
        if plan.fault == "abandon":
            try:
                response = await asyncio.wait_for(request, plan.abandon_after_s)
            except TimeoutError:
                return Outcome("client_aborted")
        else:
            response = await request
        return classify_status(plan, response.status_code, response.text)
    except httpx.TimeoutException as exc:
        return Outcome("unexpected", None, f"no answer in time: {type(exc).__name__}")
    except httpx.HTTPError as exc:
        return Outcome("unexpected", None, f"{type(exc).__name__}: {exc}")


async def _send_stream(
    client: httpx.AsyncClient, url: str, content: bytes, headers: dict[str, str], plan: Plan
) -> Outcome:
    async with client.stream("POST", url, content=content, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return classify_status(plan, response.status_code, response.text)
        read = StreamRead()
        close_after = plan.close_after_events if plan.fault == "disconnect" else None
        if close_after == 0:
            read.closed_early = True
        else:
            await read_events(response, read, close_after)
    return classify_stream(plan, read)


async def read_events(response: httpx.Response, read: StreamRead, close_after: int | None) -> None:
    """Read SSE events into ``read`` until the end, an error event, or ``close_after`` events."""
    async for line in sse_lines(response):
        if not line.startswith("data:"):
            continue
        payload = line[5:].removeprefix(" ")
        if payload == "[DONE]":
            read.finished = True
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            read.error = f"malformed event: {payload[:100]}"
            return
        read.events += 1
        if isinstance(event, dict) and "error" in event:
            read.error = event["error"]
            return
        if _is_final(event):
            read.finished = True
        if close_after is not None and read.events >= close_after and not read.finished:
            read.closed_early = True
            return


def _is_final(event: object) -> bool:
    """MindIE's and TGI's last event carries ``generated_text``; OpenAI's ends with [DONE]."""
    return isinstance(event, dict) and event.get("generated_text") is not None


def classify_status(plan: Plan, status: int, text: str) -> Outcome:
    """A whole answer, or a stream refused before its first event."""
    if plan.fault == "invalid":
        if 400 <= status < 500 and status not in (408, 429):
            return Outcome("invalid_4xx", status)
        if status == 429:
            return Outcome("too_many_429", status)
        return Outcome("unexpected", status, f"invalid body answered {status}: {text[:200]}")
    if status == 200:
        return Outcome("ok", status)
    if status == 429:
        return Outcome("too_many_429", status)
    if status == 408 and plan.fault == "timeout":
        return Outcome("timeout_408", status)
    return Outcome("unexpected", status, f"{status}: {text[:200]}")


def classify_stream(plan: Plan, read: StreamRead) -> Outcome:
    """A stream that began (status 200)."""
    if plan.fault == "invalid":
        return Outcome("unexpected", 200, "invalid body answered with a stream")
    if read.error is not None:
        if plan.fault == "timeout" and "timeout" in str(read.error).lower():
            return Outcome("timeout_408", 200)
        return Outcome("unexpected", 200, f"stream ended with an error event: {read.error}")
    if read.closed_early:
        return Outcome("client_aborted", 200)
    if not read.finished:
        return Outcome("unexpected", 200, f"stream stopped after {read.events} events, no end")
    return Outcome("ok", 200)
