"""Anthropic's Messages door (``/v1/messages``, ``/v1/messages/count_tokens``) driven by the real
``anthropic`` SDK: the predict app runs in process under uvicorn over the tiny model (its engine
stepped in process, so stop sequences and tool grammars run for real) or over a scripted text
(``auto`` tool calls parsed out of what the model wrote; a failure mid-stream). Whole and
streamed answers agree; refusals are Anthropic's error body naming the field by its path."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from coordinator.errors import GenerationFailed
from tests.conftest import make_engine
from tests.support.door_fakes import (
    TOOL_CALL_SCRIPT,
    WEATHER,
    EngineService,
    ScriptedService,
    engine_door,
    predict_app,
    serving,
)

TOOLS = [
    {"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time", "input_schema": {"type": "object"}},
]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = {"model": "tiny", "max_tokens": 24, "extra_body": {"temperature": 0.0}}
KEY = "messages-key"


@pytest.fixture(scope="module")
def door(tiny_loaded) -> Iterator[tuple[str, EngineService]]:
    with engine_door(make_engine(tiny_loaded, num_blocks=512), (KEY,)) as door:
        yield door


@pytest.fixture
def client(door) -> Iterator[anthropic.Anthropic]:
    url, service = door
    service.script = ""
    yield anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    service.script = ""


def test_a_message_whole_and_streamed_agree(client, door):
    whole = client.messages.create(messages=ASK, system="Be brief.", **GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.stop_sequence is None
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) > 0
    assert whole.usage.output_tokens == (24 if whole.stop_reason == "max_tokens" else
                                         whole.usage.output_tokens)  # fmt: skip
    with client.messages.stream(messages=ASK, system="Be brief.", **GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == block.text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the events in Anthropic's order, each named
    body = {"messages": ASK, "stream": True, "model": "tiny", "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{door[0]}/v1/messages", json=body, headers={"x-api-key": KEY})
    names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_a_stop_sequence_ends_the_text_and_is_named(client):
    free = client.messages.create(messages=ASK, **GREEDY).content[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop.strip(), free
    reply = client.messages.create(messages=ASK, stop_sequences=["\x07never", stop], **GREEDY)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert reply.content[0].text == free[: free.index(stop)]
    with client.messages.stream(messages=ASK, stop_sequences=[stop], **GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_a_named_tool_whole_and_streamed(client):
    options = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool",
               "name": "get_weather"}, "max_tokens": 200, "model": "tiny"}  # fmt: skip
    reply = client.messages.create(**options)
    assert reply.stop_reason == "tool_use", reply
    (call,) = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with client.messages.stream(**options) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and json.loads("".join(partial)) == streamed.input
    assert len(partial) > 2  # the input came as it was written, not in one piece
    jsonschema.validate(streamed.input, WEATHER)
    assert final.stop_reason == "tool_use"


def test_any_tool_is_a_required_call(client):
    reply = client.messages.create(messages=ASK, tools=TOOLS, tool_choice={"type": "any",
                                   "disable_parallel_tool_use": True},
                                   max_tokens=200, model="tiny")  # fmt: skip
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and reply.stop_reason == "tool_use"
    for call in calls:
        assert call.name in ("get_weather", "get_time")


def test_auto_reads_the_calls_the_model_wrote(client, door):
    door[1].script = TOOL_CALL_SCRIPT
    reply = client.messages.create(messages=ASK, tools=TOOLS, max_tokens=100, model="tiny")
    assert [b.type for b in reply.content] == ["text", "tool_use"]
    assert reply.content[0].text == "Checking."
    assert (reply.content[1].name, reply.content[1].input) == (
        "get_weather",
        {"city": "Oslo", "days": 2},
    )
    assert reply.stop_reason == "tool_use"
    with client.messages.stream(messages=ASK, tools=TOOLS, max_tokens=100, model="tiny") as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Oslo", "days": 2}
    # without tools the same text is text
    plain = client.messages.create(messages=ASK, max_tokens=100, model="tiny")
    assert [b.type for b in plain.content] == ["text"] and plain.stop_reason == "end_turn"


def test_a_conversation_with_tool_results_and_a_prefill(client):
    history = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "thinking", "thinking": "earlier reasoning", "signature": "x"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo", "days": 1}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    counted = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    reply = client.messages.create(messages=history, tools=TOOLS, **GREEDY)
    assert counted.input_tokens == reply.usage.input_tokens + (
        reply.usage.cache_read_input_tokens or 0
    )
    prefill = [*history, {"role": "assistant", "content": "Tomorrow it will be"}]
    longer = client.messages.count_tokens(model="tiny", messages=prefill, tools=TOOLS)
    assert longer.input_tokens > counted.input_tokens
    continued = client.messages.create(messages=prefill, tools=TOOLS, **GREEDY)
    assert not continued.content or not continued.content[0].text.startswith("Tomorrow")


BASE = {"model": "tiny", "max_tokens": 8, "messages": ASK}
REFUSED = [
    ({"model": "tiny", "messages": ASK}, "max_tokens: Field required"),
    ({**BASE, "temperature": 1.5}, "temperature: must be a number in [0, 1], got 1.5"),
    ({**BASE, "top_k": -1}, "top_k: must be an integer in [0, 2147483647], got -1"),
    ({**BASE, "best_of": 2}, "best_of: Extra inputs are not permitted"),
    ({**BASE, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    (
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}],
                }
            ],
        },
        "messages.0.content.0.type: this model reads text only",
    ),  # fmt: skip
    ({**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({**BASE, "tools": [{"name": "f", "input_schema": 3}]}, "tools.0.input_schema"),
    ({**BASE, "tools": [{**TOOLS[0], "defer_loading": True}]}, "tools.0.defer_loading"),
    (
        {**BASE, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "'tool_choice' names \"nope\", which is none of the given tools",
    ),
    (
        {**BASE, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        "thinking: this model does not think",
    ),
    ({**BASE, "stop_sequences": ["a"] * 9}, "stop_sequences"),
    (
        {**BASE, "output_config": {"format": {"type": "json_schema", "schema": 7}}},
        "output_config.format.schema",
    ),
    ({**BASE, "output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({**BASE, "container": "c_1"}, "container"),
]


@pytest.mark.parametrize(("body", "named"), REFUSED)
def test_refusals_name_the_field_in_anthropics_body(door, body, named):
    response = httpx.post(f"{door[0]}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"], error


def test_the_sdk_reads_a_refusal_and_the_server_keeps_serving(client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(messages=ASK, model="tiny", max_tokens=8,
                               thinking={"type": "enabled", "budget_tokens": 2048})  # fmt: skip
    assert "thinking" in refused.value.message
    assert client.messages.create(messages=ASK, **GREEDY).content


def test_current_fields_are_taken(client):
    """What today's SDK sends: adaptive thinking, an effort, cache markers, a speed, tool
    examples; a structured output's schema holds."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    reply = client.messages.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "A number?",
                                                "cache_control": {"type": "ephemeral"}}]}],
        model="tiny", max_tokens=40, thinking={"type": "adaptive"}, speed="fast",
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}},
        cache_control={"type": "ephemeral", "ttl": "1h"}, metadata={"user_id": "u-1"},
        service_tier="auto", inference_geo="eu",
    )  # fmt: skip
    if reply.stop_reason == "end_turn":
        jsonschema.validate(json.loads(reply.content[0].text), schema)
    else:
        assert reply.stop_reason == "max_tokens"
    tools = [{**TOOLS[0], "input_examples": [{"city": "Oslo", "days": 2}], "strict": True,
              "eager_input_streaming": True}]  # fmt: skip
    with_examples = client.messages.count_tokens(model="tiny", messages=ASK, tools=tools)
    plain = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS[:1])
    assert with_examples.input_tokens > plain.input_tokens  # the examples reach the prompt


def test_max_tokens_zero_warms_the_cache_and_answers_nothing(client):
    long = [{"role": "user", "content": "Tell me about the weather in Oslo. " * 8}]
    warmed = client.messages.create(messages=long, model="tiny", max_tokens=0)
    assert warmed.content == [] and warmed.stop_reason == "max_tokens"
    assert warmed.usage.output_tokens == 0
    again = client.messages.create(messages=long, **GREEDY)
    assert (again.usage.cache_read_input_tokens or 0) > 0


def test_the_key_is_read_from_x_api_key(door):
    url, _ = door
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(messages=ASK, **GREEDY)
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    counted = httpx.post(f"{url}/v1/messages/count_tokens", headers={"x-api-key": KEY},
                         json={"model": "tiny", "messages": ASK})  # fmt: skip
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_a_failure_mid_stream_is_an_error_event_never_an_end():
    service = ScriptedService(3, GenerationFailed("the decode worker was lost"))
    with serving(predict_app(service)) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
        failing = client.messages.stream(messages=ASK, max_tokens=10, model="fake")
        with pytest.raises(anthropic.APIStatusError, match="decode worker was lost"), failing as s:
            list(s)
        raw = httpx.post(
            f"{url}/v1/messages",
            json={"messages": ASK, "max_tokens": 10, "model": "fake", "stream": True},
        )
        names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
        assert names[-1] == "error" and "message_stop" not in names
        whole = httpx.post(
            f"{url}/v1/messages", json={"messages": ASK, "max_tokens": 10, "model": "fake"}
        )
        assert whole.status_code == 500
        assert whole.json()["error"]["type"] == "api_error"
