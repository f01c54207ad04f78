"""Structured outputs through the real cluster and the real clients: the openai SDK
(``response_format`` with a schema, ``beta.chat.completions.parse`` with a pydantic model,
streamed, vLLM's fields on ``/v1/completions``), the azure-ai-inference SDK
(``JsonSchemaFormat``) and TGI's client (``grammar``); over ZMQ and gRPC hand-offs and on a
single node. Every output validates, greedy answers equal one engine's undisturbed run, and a
hostile spec is a fast 4xx after which the server still serves.

The shared servers decode at most ``MAX_ITER`` (+1 in PD) tokens, so the schemas here have
short outputs (``{"a": 7}`` is at most 8 tokens of the tiny tokenizer)."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import JsonSchemaFormat, UserMessage
from azure.core.credentials import AzureKeyCredential
from pydantic import BaseModel, Field
from text_generation import Client as TGIClient
from text_generation.types import Grammar, GrammarType

from engine.config import CacheConfig, EngineConfig
from engine.constraint import Constraint
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.constraints import json_schema
from tests.support.coordinator_servers import API_KEY

pytestmark = pytest.mark.ray
DIGIT = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
DIGIT_FORMAT = {"type": "json_schema", "json_schema": {"name": "digit", "schema": DIGIT}}
MESSAGES = [{"role": "user", "content": "Give me a digit"}]
CODE = "[0-9]{2}-[a-z]{2}"


class Digit(BaseModel):
    a: int = Field(ge=0, le=9)


def _openai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("predict_port", "/v1"),
        api_key=API_KEY,
        max_retries=0,
        default_headers=getattr(server, "headers", None) or None,
    )


def _reference(model_dir, prompt_ids: list[int], params: SamplingParams) -> str:
    """One engine, undisturbed: the text it generates for ``prompt_ids``."""
    config = EngineConfig(
        model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
    )
    engine = LLMEngine(config)
    (tokens,) = engine.generate([prompt_ids], params)
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def _chat_ids(model_dir, messages) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.mark.parametrize("name", ["zmq", "grpc"])
def test_a_json_schema_answer_through_a_handoff_validates_and_equals_one_engine(
    servers, tiny_model_dir, name
):
    client = _openai(servers[name])
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, response_format=DIGIT_FORMAT, max_tokens=9, temperature=0
    )
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), DIGIT)
    assert choice.finish_reason == "stop"
    # the door's spec is the non-strict schema: lenient about keywords it does not implement
    lenient = json_schema({**DIGIT, "x-guidance": {"lenient": True}})
    params = SamplingParams(max_new_tokens=9, constraint=lenient)
    assert choice.message.content == _reference(
        tiny_model_dir, _chat_ids(tiny_model_dir, MESSAGES), params
    )


def test_seeded_sampling_under_a_schema_through_a_handoff_equals_one_engine(
    servers, tiny_model_dir
):
    client = _openai(servers["zmq"])
    text = (
        client.completions.create(
            model="m",
            prompt="The quick brown",
            max_tokens=9,
            temperature=1.3,
            seed=11,
            extra_body={"guided_regex": CODE},
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(CODE, text)
    params = SamplingParams(
        max_new_tokens=9,
        do_sample=True,
        temperature=1.3,
        seed=11,
        constraint=Constraint("regex", CODE),
    )
    ids = LLMEngine(EngineConfig(model_path=str(tiny_model_dir), device="cpu")).tokenizer.encode(
        "The quick brown"
    )
    assert text == _reference(tiny_model_dir, ids, params)


def test_the_sdks_parse_returns_the_pydantic_model(servers):
    client = _openai(servers["zmq"])
    completion = client.beta.chat.completions.parse(
        model="m", messages=MESSAGES, response_format=Digit, max_tokens=9
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Digit) and 0 <= parsed.a <= 9


def test_a_streamed_schema_answer_reassembles_to_valid_json(servers):
    client = _openai(servers["grpc"])
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, response_format=DIGIT_FORMAT, max_tokens=9, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), DIGIT)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_take_vllms_fields(servers):
    client = _openai(servers["zmq"])
    for extra, pattern in (
        ({"guided_choice": ["yes", "no", "maybe"]}, "yes|no|maybe"),
        ({"structured_outputs": {"regex": CODE}}, CODE),
    ):
        text = (
            client.completions.create(model="m", prompt="Is it?", max_tokens=9, extra_body=extra)
            .choices[0]
            .text
        )
        assert re.fullmatch(pattern, text), text


def test_a_long_schema_answer_on_a_single_node(servers):
    """The single-node server decodes far: a whole record, valid."""
    record = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(
        base_url=servers["single"].url("predict_port", "/v1"),
        api_key="none",
        max_retries=0,
        http_client=httpx.Client(verify=servers["single"].verify),
    )
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": record, "strict": True},
    }
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, response_format=response_format, max_tokens=200
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), record)
    assert reply.choices[0].finish_reason == "stop"


def test_the_azure_sdks_json_schema_format(servers):
    client = ChatCompletionsClient(
        endpoint=servers["zmq"].url("predict_port", ""),
        credential=AzureKeyCredential("none"),
        retry_total=0,
    )
    response_format = JsonSchemaFormat(name="digit", schema=DIGIT, strict=True)
    reply = client.complete(
        messages=[UserMessage("Give me a digit")], response_format=response_format, max_tokens=9
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), DIGIT)
    reply = client.complete(
        messages=[UserMessage("Give me a digit")], response_format="json_object", max_tokens=9
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tgis_client_grammar(servers):
    tgi = TGIClient(servers["zmq"].url("predict_port", ""), timeout=60)
    response = tgi.generate(
        "The quick brown", max_new_tokens=9, grammar=Grammar(type=GrammarType.Regex, value=CODE)
    )
    assert re.fullmatch(CODE, response.generated_text)
    response = tgi.generate(
        "The quick brown", max_new_tokens=9, grammar=Grammar(type=GrammarType.Json, value=DIGIT)
    )
    jsonschema.validate(json.loads(response.generated_text), DIGIT)


@pytest.mark.parametrize(
    "body",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "objectx"}},
            }
        },
        {"response_format": {"type": "xml"}},
        {"guided_regex": "(unclosed"},
        {"guided_grammar": "start: nowhere"},
        {
            "guided_json": {
                "type": "object",
                "properties": {
                    f"p{i}": {"type": "string", "description": "d" * 64} for i in range(1000)
                },
            }
        },
    ],
)
def test_a_hostile_spec_is_a_fast_400_and_the_server_still_serves(servers, body):
    server = servers["zmq"]
    started = time.monotonic()
    with server.client() as client:
        response = client.post(
            server.url("predict_port", "/v1/chat/completions"),
            json={"messages": MESSAGES, "max_tokens": 4, **body},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"]
        assert time.monotonic() - started < 5
        again = client.post(
            server.url("predict_port", "/v1/chat/completions"),
            json={"messages": MESSAGES, "max_tokens": 4, "response_format": DIGIT_FORMAT},
        )
        assert again.status_code == 200, again.text


def test_a_grammar_the_parser_gives_up_on_is_a_422_never_a_finish(servers):
    """A cyclic, ambiguous grammar outgrows the parser's item limit two tokens in, after the
    hand-off: the answer is the door's 422 naming the cause, not text ending ``stop``; the
    server still serves."""
    server = servers["zmq"]
    cyclic = "start: e\ne: e e | e e e | e e e e | /[a-z ]/ | f\nf: f f | /[a-z]/ | e"
    with server.client() as client:
        response = client.post(
            server.url("predict_port", "/v1/completions"),
            json={"prompt": "Give me a digit", "max_tokens": 8, "guided_grammar": cyclic},
        )
        assert response.status_code == 422, response.text
        assert "constraint_violated" in response.json()["error"]["message"]
        assert "Too many items" in response.json()["error"]["message"]
        again = client.post(
            server.url("predict_port", "/v1/chat/completions"),
            json={"messages": MESSAGES, "max_tokens": 4, "response_format": DIGIT_FORMAT},
        )
        assert again.status_code == 200, again.text
