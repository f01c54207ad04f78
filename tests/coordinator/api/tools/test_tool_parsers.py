"""The tool-call parsers: ``hermes`` and ``llama3_json`` read calls out of whole texts, take a
call from its opening (a known tool's name, then its arguments' object) with its arguments as
written, keep anything else as text, and streamed in pieces cut anywhere they give exactly the
whole text's content and calls, each call's arguments sent in pieces as they are written."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.api.tools.call_opening import ArgumentsPiece
from coordinator.api.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
)

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {}}'


def _hermes(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(HermesParser(NAMES), text)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def _llama(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(Llama3JsonParser(NAMES), text)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def test_hermes_reads_calls_and_keeps_the_text_around_them():
    assert _hermes(f"<tool_call>{WEATHER}</tool_call>") == (
        "",
        [("get_weather", {"city": "Oslo", "days": 2})],
    )
    text = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{TIME}</tool_call>\n"
    content, calls = _hermes(text)
    assert content == "Let me look." and [name for name, _ in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no calls.  ",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # no such tool
        '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',  # arguments not an object
        '<tool_call>{"arguments": {}, "name": "nope"}</tool_call>',  # read whole: no such tool
        "<tool_call",
        "a < b <tool",
    ],
)
def test_hermes_keeps_what_is_not_a_whole_known_call_as_text(text):
    assert _hermes(text) == (text, [])


@pytest.mark.parametrize(
    ("text", "call"),
    [
        (f"<tool_call>{WEATHER}", ("get_weather", '{"city": "Oslo", "days": 2}')),  # no close
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Os',
            ("get_weather", '{"city": "Os'),
        ),
        ('<tool_call>{"name": "get_time", "arguments": {</tool_call>', ("get_time", "{")),
    ],
)
def test_hermes_takes_a_known_call_from_its_opening_as_written(text, call):
    """Cut short (max_tokens) or broken, a call of a known tool stays a call: its arguments
    were sent as they were written."""
    content, calls = parse_tool_calls(HermesParser(NAMES), text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [call]


def test_a_call_read_whole_keeps_its_arguments_order_free():
    text = '<tool_call>{"arguments": {"days": 1}, "name": "get_weather"}</tool_call>'
    assert _hermes(text) == ("", [("get_weather", {"days": 1})])


def test_llama3_json_reads_one_or_several_calls():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert _llama(one) == ("", [("get_weather", {"city": "Oslo"})])
    several = f'<|python_tag|>{one}; {{"name": "get_time", "arguments": {{}}}}'
    assert [name for name, _ in _llama(several)[1]] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text",
    [
        "Hello there",
        '{"name": "nope", "parameters": {}}',
        "{not json",
        "  ",
    ],
)
def test_llama3_json_keeps_other_outputs_as_text(text):
    assert _llama(text) == (text, [])


def test_llama3_json_takes_a_known_call_from_its_opening():
    assert _llama('{"name": "get_time", "parameters": {}} trailing') == (
        "trailing", [("get_time", {})],
    )  # fmt: skip
    content, calls = parse_tool_calls(Llama3JsonParser(NAMES), '{"name": "get_time", '
                                      '"parameters": {"a": [1, 2')  # fmt: skip
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", '{"a": [1, 2')]


def test_call_ids_are_call_and_24_letters_or_digits():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


SAMPLES = [
    f"Sure.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>",
    f"<tool_call>{WEATHER}</tool_call> and then <tool_call>{TIME}",
    'text <tool_call>{"name": "x", "arguments": {}}</tool_call> more < tail <tool_',
    "Plain answer with <b>tags</b>  \n",
    '  {"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
]


def _streamed(parser_type, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(parser_type(NAMES))
    content, calls = "", []
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        delta = stream.feed(text[start:end])
        content += delta.text
        calls += [(c.name, c.arguments) for c in delta.calls]
    last = stream.finish()
    return content + last.text, calls + [(c.name, c.arguments) for c in last.calls]


@settings(max_examples=300, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    parser_type=st.sampled_from([HermesParser, Llama3JsonParser]),
    data=st.data(),
)
def test_streaming_in_any_pieces_gives_the_whole_texts_answer(sample, parser_type, data):
    cuts = data.draw(st.lists(st.integers(0, len(sample)), max_size=12))
    content, calls = parse_tool_calls(parser_type(NAMES), sample)
    whole = (content, [(c.name, c.arguments) for c in calls])
    assert _streamed(parser_type, sample, cuts) == whole


def test_streamed_text_is_sent_once_it_cannot_begin_a_call():
    stream = ToolCallStream(HermesParser(NAMES))
    assert stream.feed("Hi <tool").text == "Hi"  # the space waits, so does what may be a tag
    assert stream.feed("box> x").text == " <toolbox> x"
    assert stream.feed(f" <tool_call>{WEATHER}</tool_call>").calls
    assert stream.finish().text == ""


def test_arguments_stream_as_they_are_written():
    stream = ToolCallStream(HermesParser(NAMES))
    pieces = ["Sure <tool_", 'call>{"name": "get_we', 'ather", "arguments": {"ci', 'ty": "Os',
              'lo", "days"', ": 2}}</tool", "_call> done"]  # fmt: skip
    parts = [part for piece in pieces for part in stream.feed(piece).parts]
    parts += stream.finish().parts
    kinds = [type(part).__name__ for part in parts]
    assert kinds[:2] == ["str", "CallOpened"] and kinds[-2:] == ["ToolCall", "str"]
    arguments = [part.text for part in parts if isinstance(part, ArgumentsPiece)]
    assert len(arguments) >= 4  # sent as written, not at the call's end
    (call,) = [part for part in parts if isinstance(part, ToolCall)]
    assert "".join(arguments) == call.arguments == '{"city": "Oslo", "days": 2}'
    assert parts[1].id == call.id and call.id in stream.streamed
