"""Tool calls through a real coordinator and its Ray workers (the ``single`` server: the others
stop every request after 8 tokens, too few for a call): the grammar of a named choice reaches
the engine with the request, and the openai client reads the call whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.ray

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    server = servers["single"]
    return openai.OpenAI(
        base_url=server.url("predict_port", "/v1"),
        api_key="none",
        max_retries=0,
        http_client=server.client(),
    )


def test_a_named_call_whole_and_streamed(client):
    options = {"model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "seed": 3}
    reply = client.chat.completions.create(max_tokens=160, **options)
    assert reply.choices[0].finish_reason == "tool_calls", reply
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    chunks = list(client.chat.completions.create(max_tokens=160, stream=True, **options))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_hostile_tools_are_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=ASK, tool_choice="required")
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
