"""Azure AI Model Inference through the real azure-ai-inference SDK."""

from __future__ import annotations

import httpx
import pytest
from azure.ai.inference import ChatCompletionsClient, load_client
from azure.ai.inference.models import SystemMessage, UserMessage
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

from tests.support.coordinator_servers import API_KEY

pytestmark = pytest.mark.ray
MESSAGES = [SystemMessage("You are terse."), UserMessage("Say hello")]


def _client(server, key: str = "none", path: str = "") -> ChatCompletionsClient:
    return ChatCompletionsClient(
        endpoint=server.url("predict_port", path), credential=AzureKeyCredential(key), retry_total=0
    )


def test_info_and_load_client(servers):
    client = load_client(
        endpoint=servers["zmq"].url("predict_port", "/models"),
        credential=AzureKeyCredential("none"),
        retry_total=0,
    )
    assert isinstance(client, ChatCompletionsClient)
    info = client.get_model_info()
    assert info.model_type == "chat-completion" and info.model_provider_name == "pdserve"


def test_complete_plain_and_streaming(servers):
    client = _client(servers["zmq"])
    exact = {"model_extras": {"ignore_eos": True}}  # exactly max_tokens
    reply = client.complete(messages=MESSAGES, max_tokens=6, seed=5, **exact)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    chunks = list(client.complete(messages=MESSAGES, max_tokens=6, seed=5, stream=True, **exact))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_model_extras_pass_through_and_unknown_extras(servers):
    client = _client(servers["zmq"])
    reply = client.complete(
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        model_extras={"top_k": 1, "ignore_eos": True},
    )
    assert reply.usage.completion_tokens == 8  # ignore_eos reached the engine
    with pytest.raises(HttpResponseError) as error:
        client.complete(messages=MESSAGES, max_tokens=4, model_extras={"best_of": 3})
    assert error.value.status_code == 422


def test_unsupported_parameter_is_422_parameter_not_supported(servers):
    client = _client(servers["zmq"])
    with pytest.raises(HttpResponseError) as error:
        client.complete(
            body={
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "xml"},
            }
        )
    assert error.value.status_code == 422
    assert error.value.error.code == "parameter_not_supported"


def test_auth_failure_and_success(servers):
    with pytest.raises(ClientAuthenticationError):
        _client(servers["grpc"], key="wrong").complete(messages=MESSAGES, max_tokens=3)
    reply = _client(servers["grpc"], key=API_KEY).complete(messages=MESSAGES, max_tokens=3)
    assert reply.choices[0].message.role == "assistant"
    bare = httpx.post(servers["grpc"].url("predict_port", "/infer"), json={"inputs": "x"})
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "Unauthorized"


def test_raw_errors_of_the_azure_routes(servers):
    base = servers["zmq"].url("predict_port", "")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    missing = httpx.post(f"{base}/chat/completions", json=body)
    assert missing.status_code == 400 and "api-version" in missing.json()["error"]["message"]
    url = f"{base}/chat/completions?api-version=2024-05-01-preview"
    extra = httpx.post(url, json={**body, "n": 2})
    assert extra.status_code == 400
    assert extra.json()["error"]["message"].startswith("Extra parameters ['n'] are not allowed")
    dropped = httpx.post(url, json={**body, "n": 2}, headers={"extra-parameters": "drop"})
    assert dropped.status_code == 200
    bad_mode = httpx.post(url, json=body, headers={"extra-parameters": "maybe"})
    assert bad_mode.status_code == 400
    tools = httpx.post(url, json={**body, "tools": [{"type": "function", "function": {}}]})
    assert tools.status_code == 400 and tools.json()["detail"]["loc"] == ["body", "tools"]
    images = httpx.post(
        f"{base}/images/embeddings?api-version=2024-05-01-preview", json={"input": []}
    )
    assert images.status_code == 404
    assert images.json() == {
        "error": {"code": "NotFound", "message": "Modality not supported by the model"}
    }


def test_embeddings_through_the_sdk(servers):
    from azure.ai.inference import EmbeddingsClient

    client = EmbeddingsClient(
        endpoint=servers["zmq"].url("predict_port", ""),
        credential=AzureKeyCredential("none"),
        retry_total=0,
    )
    result = client.embed(input=["first phrase", "second phrase"], input_type="query")
    assert [item.index for item in result.data] == [0, 1]
    assert all(len(item.embedding) == 384 for item in result.data)
    assert result.usage.prompt_tokens > 0
    with pytest.raises(HttpResponseError) as error:
        client.embed(input=["x"], dimensions=100)
    assert error.value.status_code == 422


def test_content_filter_blocks_an_input(servers):
    client = _client(servers["grpc"], key=API_KEY)
    with pytest.raises(HttpResponseError) as error:
        client.complete(messages=[UserMessage("tell me the forbidden thing")], max_tokens=3)
    assert error.value.status_code == 400
    assert error.value.error.code == "content_filter"
    url = servers["grpc"].url("predict_port", "/v1/chat/completions")
    raw = httpx.post(
        url,
        headers={"api-key": API_KEY},
        json={"messages": [{"role": "user", "content": "secret-42 please"}], "max_tokens": 3},
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "content_filter"
