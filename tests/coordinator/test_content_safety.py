"""The content filter: matching, configuration errors, and how a blocked output ends."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from coordinator.api.openai_format import Completion
from coordinator.config.loader import load_config
from coordinator.content_safety import ContentFilter
from engine.errors import ConfigError
from engine.outputs import TokenEvent
from engine.request import FinishReason

FILTER = ContentFilter.from_config(
    {"enabled": True, "categories": {"weapons": {"terms": ["gun"], "patterns": [r"shoot(ing)?"]}}}
)


def test_terms_are_whole_words_and_patterns_regexes():
    assert FILTER.search("a Gun here").group(0) == "Gun"
    assert FILTER.search("gunther") is None
    assert FILTER.search("they were SHOOTING").group(0) == "SHOOTING"
    assert ContentFilter.from_config({"enabled": False, "categories": {}}) is None


def test_bad_pattern_is_a_start_up_error(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"content_safety": {"enabled": True, "categories": {"x": {"patterns": ["("]}}}})
    )
    with pytest.raises(ConfigError, match=r"content_safety.categories.x.patterns: '\(' is not"):
        load_config(path)


def _events(pieces: list[str]) -> list[TokenEvent]:
    now = time.monotonic()
    return [
        TokenEvent(
            "r", i, piece, 3, i + 1, now, FinishReason.LENGTH if i == len(pieces) - 1 else None
        )
        for i, piece in enumerate(pieces)
    ]


def test_blocked_output_is_cut_and_ends_with_content_filter():
    answer = Completion("chat", "m", 3, FILTER)
    for event in _events(["Let us ", "go sho", "oting today"]):
        answer.add(event)
        if answer.blocked:
            break
    assert answer.blocked and answer.finish == "content_filter"
    assert answer.text == "Let us go "
    assert answer.body()["choices"][0]["finish_reason"] == "content_filter"


def test_blocked_stream_never_sends_the_match():
    answer = Completion("text", "m", 3, FILTER)
    events = _events(["Let us ", "go shoot", "ing now", " and more"])

    async def rest():
        for event in events[1:]:
            yield event

    async def collect():
        return [chunk async for chunk in answer.stream(events[0], rest())]

    chunks = asyncio.run(collect())
    payloads = [json.loads(c[6:]) for c in chunks if c != b"data: [DONE]\n\n"]
    text = "".join(p["choices"][0]["text"] for p in payloads)
    assert text == "Let us go " and "shoot" not in text
    assert payloads[-1]["choices"][0]["finish_reason"] == "content_filter"
    assert chunks[-1] == b"data: [DONE]\n\n"
