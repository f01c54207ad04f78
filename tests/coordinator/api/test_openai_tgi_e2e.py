"""OpenAI-style and TGI routes through the real clients (``openai``, ``text-generation``)."""

from __future__ import annotations

import httpx
import openai
import pytest
from text_generation import Client as TGIClient
from text_generation.errors import ValidationError

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.model_files import model_name
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=servers["zmq"].url("predict_port", "/v1"), api_key="none", max_retries=0
    )


def test_models_list(client, tiny_model_dir):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name(str(tiny_model_dir))]


def test_chat_completion_plain_and_streaming(client):
    messages = [{"role": "user", "content": "Say hello"}]
    exact = {"ignore_eos": True}  # pdserve's extension: exactly max_tokens
    reply = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, seed=3, extra_body=exact
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=6,
        seed=3,
        extra_body=exact,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    *_, finish, usage = chunks  # the usage asked for comes in a chunk of its own
    assert finish.choices[0].finish_reason == choice.finish_reason and finish.usage is None
    assert usage.choices == [] and usage.usage.completion_tokens == reply.usage.completion_tokens


def test_completion_with_a_stop_string_cut_from_the_answer(client):
    greedy = {"model": "m", "prompt": "The quick brown", "max_tokens": 8, "temperature": 0}
    exact = {"ignore_eos": True}  # eight tokens whatever the tiny model prefers
    free = client.completions.create(**greedy, extra_body=exact)
    text = free.choices[0].text
    assert free.usage.completion_tokens == 8 and len(text) >= 4, text
    stop = text[2:4]  # spans token boundaries more often than not
    cut = client.completions.create(**greedy, stop=[stop], extra_body=exact)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(**greedy, stop=stop, stream=True, extra_body=exact)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert error.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a number in"):
        client.completions.create(model="m", prompt="x", temperature=3)


def _greedy(model_dir, text: str, max_new_tokens: int) -> tuple[str, int]:
    """The engine alone: greedy text and number of tokens."""
    engine = LLMEngine(
        EngineConfig(
            model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
        )
    )
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.add_request(engine.request("reference", engine.tokenizer.encode(text), params))
    events = []
    while engine.has_work():
        events += engine.step()
    return "".join(e.text for e in events), sum(e.token_id is not None for e in events)


def test_tgi_client_generate_and_stream(servers, tiny_model_dir):
    url = servers["zmq"].url("predict_port", "")
    tgi = TGIClient(url, timeout=60)
    response = tgi.generate("The quick brown", max_new_tokens=5, seed=4)
    text, num_tokens = _greedy(tiny_model_dir, "The quick brown", 5)
    assert response.generated_text == text
    assert response.details.generated_tokens == len(response.details.tokens) == num_tokens
    assert response.details.finish_reason.value == ("length" if num_tokens == 5 else "eos_token")
    tokens = list(tgi.generate_stream("The quick brown", max_new_tokens=5, seed=4))
    assert "".join(t.token.text for t in tokens) == response.generated_text
    assert tokens[-1].generated_text == response.generated_text
    with pytest.raises(ValidationError):
        tgi.generate("The quick brown", max_new_tokens=5, top_p=1.0)


def test_tgi_routes_directly(servers):
    url = servers["zmq"].url("predict_port", "/generate")
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
    answer = httpx.post(url, json=body, timeout=60).json()
    assert set(answer) == {"generated_text", "details"}
    assert answer["details"]["generated_tokens"] == 3
    bad = httpx.post(url, json={"inputs": "hello", "parameters": {"top_k": 0}}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


def test_openai_embeddings_float_and_base64(client):
    import math

    floats = client.embeddings.create(
        model="m", input=["hello world", "goodbye"], encoding_format="float"
    )
    default = client.embeddings.create(model="m", input=["hello world", "goodbye"])  # base64
    assert [len(d.embedding) for d in floats.data] == [384, 384]
    for a, b in zip(floats.data, default.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert math.isclose(sum(x * x for x in floats.data[0].embedding), 1.0, rel_tol=1e-4)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0


def test_azure_openai_v1_serves_chat_embeddings_and_models(servers, tiny_model_dir):
    """Azure OpenAI's v1 API: OpenAI's routes under ``/openai/v1``, ``api-version`` optional."""
    base = servers["zmq"].url("predict_port", "/openai/v1")
    for query in (None, {"api-version": "preview"}):
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, default_query=query)
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.object == "chat.completion" and reply.usage.completion_tokens > 0
        vectors = client.embeddings.create(model="m", input=["hello"], encoding_format="float")
        assert len(vectors.data[0].embedding) == 384
        assert [m.id for m in client.models.list().data] == [model_name(str(tiny_model_dir))]
    bogus = openai.OpenAI(base_url=base, api_key="none", max_retries=0,
                          default_query={"api-version": "1999-01-01"})  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        bogus.models.list()
    assert refused.value.body["param"] == "api-version"  # type: ignore[index]


def test_logprobs_across_the_hand_off(client):
    """The first token's figures come from the prefill worker, the rest from the decode worker:
    every token has them, whole and streamed alike."""
    options = {"model": "m", "messages": [{"role": "user", "content": "Say hello"}],
               "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    whole = client.chat.completions.create(**options)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens > 1
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **options)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    for later, first in zip(streamed, content, strict=True):
        assert later.logprob == pytest.approx(first.logprob, abs=1e-4)


def test_responses_across_the_hand_off(client):
    """``client.responses`` on pd_separate: whole and streamed alike, and a stored response's
    conversation goes on."""
    options = {"model": "m", "input": "Say hello", "max_output_tokens": 6, "temperature": 0}
    whole = client.responses.create(**options)
    assert whole.output_text and whole.usage.output_tokens > 0
    events = list(client.responses.create(stream=True, **options))
    assert events[-1].type == f"response.{whole.status}"
    assert events[-1].response.output_text == whole.output_text
    later = client.responses.create(previous_response_id=whole.id, **options)
    assert later.usage.input_tokens > whole.usage.input_tokens
