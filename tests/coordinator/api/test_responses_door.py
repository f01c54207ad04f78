"""OpenAI's Responses API (``/v1/responses``) driven by the real ``openai`` client's
``client.responses``: the predict app runs in process under uvicorn over the tiny model (its
engine stepped in process) or over a scripted text (``auto`` tool calls; a failure mid-stream).
Whole and streamed answers agree; tools, JSON schemas, log probabilities and stored
conversations (``previous_response_id``, per key) work; refusals name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from coordinator.api.responses_store import ResponseStore
from coordinator.door_limits import DoorLimits
from coordinator.errors import GenerationFailed, StoreUnavailable
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
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "description": "The time"},
]
GREEDY = {"model": "tiny", "max_output_tokens": 16, "temperature": 0}
KEY_A, KEY_B = "responses-key-a", "responses-key-b"


@pytest.fixture(scope="module")
def door(tiny_loaded) -> Iterator[tuple[str, EngineService]]:
    with engine_door(make_engine(tiny_loaded, num_blocks=512), (KEY_A, KEY_B)) as door:
        yield door


@pytest.fixture
def client(door) -> Iterator[openai.OpenAI]:
    url, service = door
    service.script = ""
    yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0)
    service.script = ""


def test_a_response_whole_and_streamed_agree(client):
    whole = client.responses.create(input="Say something", instructions="Be brief.", **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete") and whole.output_text
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0
    # the raw events: the SDK's stream helper reads only a response.completed (as OpenAI's API
    # ends a response cut by max_output_tokens with response.incomplete)
    events = list(client.responses.create(input="Say something", instructions="Be brief.",
                                          stream=True, **GREEDY))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == f"response.{whole.status}"
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"


def test_a_named_tool_streams_its_arguments(client):
    named = {"type": "function", "name": "get_weather"}
    options = {"input": "Weather in Oslo?", "tools": TOOLS, "max_output_tokens": 200,
               "model": "tiny", "tool_choice": named}  # fmt: skip
    reply = client.responses.create(**options)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**options) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert len(pieces) > 2 and "".join(pieces) == streamed.arguments
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)


def test_auto_reads_the_calls_the_model_wrote_and_takes_their_outputs(client, door):
    door[1].script = TOOL_CALL_SCRIPT
    reply = client.responses.create(input="Weather in Oslo?", tools=TOOLS, model="tiny")
    assert [item.type for item in reply.output] == ["message", "function_call"]
    assert reply.output_text == "Checking."
    call = reply.output[1]
    assert json.loads(call.arguments) == {"city": "Oslo", "days": 2}
    door[1].script = ""
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]  # fmt: skip
    answered = client.responses.create(input=history, tools=TOOLS, **GREEDY)
    assert answered.status in ("completed", "incomplete") and answered.output


def test_a_json_schema_holds_through_text_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    reply = client.responses.create(
        input="A number?", model="tiny", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )  # fmt: skip
    if reply.status == "completed":
        jsonschema.validate(json.loads(reply.output_text), schema)


def test_a_conversation_goes_on_from_a_stored_response(client, door):
    first = client.responses.create(input="My name is Ada.", **GREEDY)
    fresh = client.responses.create(input="What is my name?", **GREEDY)
    later = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                    **GREEDY)  # fmt: skip
    assert later.previous_response_id == first.id
    assert later.usage.input_tokens > fresh.usage.input_tokens  # the stored turns came first
    assert client.responses.retrieve(first.id).id == first.id
    other = openai.OpenAI(base_url=f"{door[0]}/v1", api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another key's tenant never reads it
        other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(input="x", previous_response_id=first.id, **GREEDY)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    unstored = client.responses.create(input="Hello", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_logprobs_when_included(client):
    reply = client.responses.create(input="Say something", include=["message.output_text.logprobs"],
                                    top_logprobs=3, **GREEDY)  # fmt: skip
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == reply.usage.output_tokens
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in logprobs)
    plain = client.responses.create(input="Say something", **GREEDY)
    assert not plain.output[0].content[0].logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"background": True}, "background"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format"),
    ],
)
def test_refusals_name_the_field(client, fields, param):
    body = {"model": "tiny", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**body)
    assert refused.value.body["param"].startswith(param), refused.value.body  # type: ignore[index]


def test_a_field_the_api_does_not_define_is_400(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input="hi", extra_body={"best_of": 2})
    assert refused.value.body["param"] == "best_of"  # type: ignore[index]


def test_a_failure_mid_stream_is_response_failed_never_completed():
    service = ScriptedService(3, GenerationFailed("the decode worker was lost"))
    with serving(predict_app(service)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.responses.create(model="fake", input="hi", stream=True)
        kinds = [event.type for event in stream]
        assert kinds[-1] == "response.failed" and "response.completed" not in kinds
        whole = httpx.post(f"{url}/v1/responses", json={"model": "fake", "input": "hi"})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"


def test_with_no_store_configured_storing_is_refused_and_nothing_kept():
    """``request_limit.responses_store_mb: 0``: ``store: true`` and ``previous_response_id``
    are 400 naming them; a request that leaves ``store`` out is answered and kept nowhere."""
    limits = DoorLimits(responses_store_mb=0)
    with serving(predict_app(ScriptedService(3), door_limits=limits)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        asks = (({"store": True}, "store"), ({"previous_response_id": "r"}, "previous_response_id"))
        for fields, param in asks:
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(model="fake", input="hi", **fields)
            assert refused.value.body["param"] == param  # type: ignore[index]
        answered = client.responses.create(model="fake", input="hi")
        assert answered.output_text == "aba" and answered.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(answered.id)


class Unreachable:
    """A shared pool's store that cannot be reached (its actor lost)."""

    def __init__(self, store: ResponseStore) -> None:
        self.puts = 0

    async def put(self, tenant: str, response: dict, conversation: list) -> bool:
        self.puts += 1
        return False  # SharedResponses logs it and keeps nothing

    async def get(self, tenant: str, response_id: str) -> None:
        raise StoreUnavailable("the response store is unreachable")

    async def delete(self, tenant: str, response_id: str) -> bool:
        raise StoreUnavailable("the response store is unreachable")


def test_an_unreachable_shared_store_is_503_to_retry_and_answers_go_on():
    made: list[Unreachable] = []

    def shared(store: ResponseStore) -> Unreachable:
        made.append(Unreachable(store))
        return made[-1]

    with serving(predict_app(ScriptedService(3), shared_responses=shared)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answered = client.responses.create(model="fake", input="hi")  # answered, not kept
        assert answered.output_text == "aba" and made[0].puts == 1
        for ask in (
            lambda: client.responses.retrieve(answered.id),
            lambda: client.responses.delete(answered.id),
            lambda: client.responses.create(model="fake", input="hi", previous_response_id="r"),
        ):
            with pytest.raises(openai.InternalServerError) as refused:
                ask()
            assert refused.value.status_code == 503
            assert refused.value.response.headers["retry-after"] == "1"
