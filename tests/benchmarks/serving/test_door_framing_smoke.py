"""``benchmarks.serving.door_framing`` at toy size: every door measured with both encoders into a
result file, the doors' streams the same whichever encoder wrote them, and orjson back in place
after the run."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks.report import render_door_framing
from benchmarks.serving import door_framing
from benchmarks.serving.door_framing import DOORS, ENCODERS, request_events
from coordinator.api import sse
from coordinator.api.common import raising_failures

VOLATILE = {"id", "created", "prefill_time", "decode_time"}  # per request or per clock


def _without_volatile(value):
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_without_volatile(v) for v in value]
    return value


def _stream(door: str, encoder: str) -> list:
    async def chunks() -> list[bytes]:
        events = raising_failures(door_framing._served(request_events(6)))
        first = await anext(events)
        return [chunk async for chunk in DOORS[door]().stream(first, events)]

    sse.dumps = ENCODERS[encoder]
    try:
        sent = asyncio.run(chunks())
    finally:
        sse.dumps = ENCODERS["orjson"]
    data = [c.split(b":", 1)[1].strip() for c in sent]
    return [d.decode() if d == b"[DONE]" else _without_volatile(json.loads(d)) for d in data]


@pytest.mark.parametrize("door", list(DOORS))
def test_a_door_streams_the_same_events_with_either_encoder(door):
    streamed = _stream(door, "orjson")
    assert streamed == _stream(door, "stdlib")
    assert len(streamed) >= 6  # one event per token at least


def test_door_framing_toy_run(tmp_path):
    out = tmp_path / "door_framing.json"
    door_framing.main(["--tokens", "8", "--repeat", "2", "--rounds", "2", "--warmup", "0",
                       "--scratch", "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["doors"]) == set(DOORS)
    for door in result["doors"].values():
        assert door["orjson"]["median"] > 0 and door["stdlib"]["median"] > 0
        assert len(door["ratio"]["rounds"]) == 2
        assert door["verdict"]["verdict"] == "undecided"  # two rounds decide nothing
    assert sse.dumps is ENCODERS["orjson"]
    assert result["_meta"]["complete"]
    table = render_door_framing(result)
    assert all(f"| {door} |" in table for door in DOORS)
