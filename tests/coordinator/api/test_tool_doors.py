"""Tool calls through the OpenAI and Azure chat doors, driven by the real ``openai`` and
``azure-ai-inference`` clients: the predict app runs in process under uvicorn over the tiny model
(its engine stepped in process, so ``required`` and named choices run under their grammar) or
over a scripted text (``auto``, whose calls are parsed out of what the model wrote). Hostile tool
fields are 400 at once and the server keeps serving."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import (
    AssistantMessage,
    ChatCompletionsNamedToolChoice,
    ChatCompletionsNamedToolChoiceFunction,
    ChatCompletionsToolCall,
    ChatCompletionsToolChoicePreset,
    ChatCompletionsToolDefinition,
    CompletionsFinishReason,
    FunctionCall,
    FunctionDefinition,
    ToolMessage,
    UserMessage,
)
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import HttpResponseError

from engine.constraint import MAX_SPEC_CHARS
from tests.conftest import make_engine
from tests.support.door_fakes import (
    AZURE_CHAT,
    TOOL_CALL_SCRIPT,
    WEATHER,
    EngineService,
    engine_door,
)

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def door(tiny_loaded) -> Iterator[tuple[str, EngineService]]:
    with engine_door(make_engine(tiny_loaded, num_blocks=512), ()) as door:
        yield door


@pytest.fixture
def client(door) -> Iterator[openai.OpenAI]:
    url, service = door
    service.script = ""
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    service.script = ""


@pytest.fixture
def azure(door) -> ChatCompletionsClient:
    url, service = door
    service.script = ""
    return ChatCompletionsClient(endpoint=url, credential=AzureKeyCredential("unused"))


def _check_call(name: str, arguments: str) -> None:
    if name == "get_weather":
        jsonschema.validate(json.loads(arguments), WEATHER)
    else:
        assert name == "get_time" and json.loads(arguments) == {}


SAMPLED = {"temperature": 1.5, "seed": 5, "max_tokens": 200}


def test_required_answers_with_valid_calls(client):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", **SAMPLED
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        _check_call(call.function.name, call.function.arguments)
    assert reply.usage.completion_tokens > 0


def test_a_named_choice_streams_one_call_the_sdk_reassembles(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    calls: dict[int, dict[str, str]] = {}
    finishes, usage, pieces = [], None, 0
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
                pieces += bool(delta.function and delta.function.arguments)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert pieces > 2, "the arguments came in one piece, not as they were written"
    assert calls[0]["id"].startswith("call_")
    _check_call(calls[0]["name"], calls[0]["arguments"])
    assert [f for f in finishes if f] == ["tool_calls"] and usage is not None


def test_the_sdks_stream_helper_reassembles_calls(client):
    with client.beta.chat.completions.stream(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, **SAMPLED
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)


def test_auto_parses_the_calls_the_model_wrote(client, door):
    door[1].script = TOOL_CALL_SCRIPT
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Checking."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    streamed = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True)
    chunks = list(streamed)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking." and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_keeps_an_unknown_call_as_text_and_none_parses_nothing(client, door):
    door[1].script = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == door[1].script
    assert reply.choices[0].finish_reason == "stop"
    door[1].script = TOOL_CALL_SCRIPT
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert (
        none.choices[0].message.content == TOOL_CALL_SCRIPT
        and none.choices[0].finish_reason == "stop"
    )


def test_a_tool_result_round_trip_answers(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=4, seed=1
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 50  # the tools, the call and its result were all read


def _assert_required_choice_calls_the_tool(azure, tools) -> None:
    """``tool_choice`` required (one call at a time): the reply calls ``get_weather``."""
    reply = azure.complete(
        messages=[UserMessage("Weather in Oslo?")],
        tools=tools,
        tool_choice=ChatCompletionsToolChoicePreset.REQUIRED,
        model_extras={"parallel_tool_calls": False},  # one call: a random model may not stop
        **SAMPLED,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == CompletionsFinishReason.TOOL_CALLS
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    _check_call(calls[0].function.name, calls[0].function.arguments)


def _streamed_named_call_arguments(azure, tools) -> str:
    """The arguments a streamed reply with ``get_weather`` named as the tool choice calls with."""
    named = ChatCompletionsNamedToolChoice(
        function=ChatCompletionsNamedToolChoiceFunction(name="get_weather")
    )
    updates = list(
        azure.complete(
            messages=[UserMessage("Weather?")],
            tools=tools,
            tool_choice=named,
            stream=True,
            **SAMPLED,
        )
    )
    arguments = "".join(
        d.function.arguments or ""
        for u in updates
        if u.choices
        for d in u.choices[0].delta.tool_calls or []
    )
    _check_call("get_weather", arguments)
    return arguments


def _assert_the_tool_result_round_trips(azure, tools, arguments: str) -> None:
    """A history with the call and its tool message in it is answered."""
    previous = ChatCompletionsToolCall(
        id="call_1", function=FunctionCall(name="get_weather", arguments=arguments)
    )
    history = [
        UserMessage("Weather?"),
        AssistantMessage(tool_calls=[previous]),
        ToolMessage("rain", tool_call_id="call_1"),
    ]
    answer = azure.complete(messages=history, tools=tools, max_tokens=3, seed=2)
    assert answer.choices[0].finish_reason is not None


def test_azure_sdk_required_named_and_a_round_trip(azure):
    weather = FunctionDefinition(name="get_weather", description="Weather", parameters=WEATHER)
    tools = [ChatCompletionsToolDefinition(function=weather)]
    _assert_required_choice_calls_the_tool(azure, tools)
    arguments = _streamed_named_call_arguments(azure, tools)
    _assert_the_tool_result_round_trips(azure, tools, arguments)


# ---- hostile input ----

MANY = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]
HUGE = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "x": "y" * MAX_SPEC_CHARS}},
    }
]
HOSTILE = [
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": MANY}, "tools"),
    ({"tools": HUGE}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
            ],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
    ),
    ({"messages": [{"role": "tool", "content": "x"}], "tools": TOOLS}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize(("extra", "param"), HOSTILE)
def test_hostile_tools_are_400_at_once_on_both_doors(door, extra, param):
    url, _ = door
    body = {"messages": ASK, "max_tokens": 2, **extra}
    start = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"'{param}'" in error["message"] or param == "tools"
    azure = httpx.post(f"{url}{AZURE_CHAT}", json=body, timeout=30)
    assert azure.status_code == 400, azure.text
    if not param.startswith("messages"):
        assert azure.json()["detail"]["loc"] == ["body", param.split(".")[0].split("[")[0]]
    assert time.monotonic() - start < 5
    fine = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
    assert fine.status_code == 200


def test_the_azure_sdk_raises_on_a_refused_tool_choice(azure):
    weather = FunctionDefinition(name="get_weather", parameters=WEATHER)
    unknown = ChatCompletionsNamedToolChoice(
        function=ChatCompletionsNamedToolChoiceFunction(name="nope")
    )
    with pytest.raises(HttpResponseError) as refused:
        azure.complete(
            messages=[UserMessage("hi")],
            tools=[ChatCompletionsToolDefinition(function=weather)],
            tool_choice=unknown,
        )
    assert refused.value.status_code == 400 and "nope" in str(refused.value)
