"""MLflow models served by real ``pdserve`` processes: an ``llm/v1/chat`` model (saved
model_config, a load-time override) and an ``llm/v1/embeddings`` model (embeddings only)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from engine.embedding_model import EmbeddingModel
from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from tests.support.mlflow_models import CHAT_NAME, EMBED_NAME

pytestmark = pytest.mark.ray
MESSAGES = [{"role": "user", "content": "Tell me about the fox."}]
LOADED_MAX_NEW_TOKENS = 5  # the saved 6, overridden at load time


@pytest.fixture(scope="module")
def mlflow_servers(tmp_path_factory, mlflow_chat_dir, mlflow_embed_dir):
    backend = {"device": "cpu", "cacheBlockSize": 4, "kvCacheMemoryMB": 4}
    chat = start_coordinator(
        tmp_path_factory.mktemp("mlflow-chat"),
        {
            "digs_scheduler_config": {"deploy_mode": "single_node"},
            "backend_config": {**backend, "embedding_model_path": ""},
        },
        "--model",
        str(mlflow_chat_dir),
        "--model-config",
        json.dumps({"max_new_tokens": LOADED_MAX_NEW_TOKENS, "top_k": 3}),
    )
    embed = start_coordinator(
        tmp_path_factory.mktemp("mlflow-embed"),
        {"backend_config": {**backend, "model_path": str(mlflow_embed_dir)}},
    )
    try:
        chat.wait_ready()
        embed.wait_ready()
        yield {"chat": chat, "embed": embed}
    finally:
        assert chat.stop() == 0 and embed.stop() == 0


def invoke(server: CoordinatorProcess, body, **kwargs) -> httpx.Response:
    with server.client() as client:
        return client.post(server.url("predict_port", "/invocations"), json=body, **kwargs)


def test_scoring_server_routes(mlflow_servers, mlflow_chat_dir):
    server = mlflow_servers["chat"]
    with server.client() as client:
        for path in ("/ping", "/health"):
            response = client.get(server.url("predict_port", path))
            assert (response.status_code, response.text) == (200, "\n")
        import mlflow

        assert client.get(server.url("predict_port", "/version")).text == mlflow.__version__


def test_unified_chat_body_uses_the_loaded_model_config(mlflow_servers):
    response = invoke(mlflow_servers["chat"], {"messages": MESSAGES})
    assert response.status_code == 200, response.text
    [answer] = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == CHAT_NAME
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == LOADED_MAX_NEW_TOKENS
    assert answer["choices"][0]["finish_reason"] == "length"
    again = invoke(mlflow_servers["chat"], {"messages": MESSAGES}).json()[0]
    assert again["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]


def test_the_saved_override_was_reported_for_unsaved_keys(mlflow_servers):
    log = mlflow_servers["chat"].log_path.read_text()
    assert "model_config overrides ['top_k'] ignored" in log


@pytest.mark.parametrize(
    "body",
    [
        {"dataframe_split": {"columns": ["messages", "max_tokens"], "data": [[MESSAGES, 2]] * 2}},
        {"dataframe_records": [{"messages": MESSAGES, "max_tokens": 2}, {"messages": MESSAGES}]},
        {
            "instances": [{"messages": MESSAGES}, {"messages": MESSAGES}],
            "params": {"max_tokens": 2},
        },
        {"inputs": {"messages": [MESSAGES, MESSAGES], "max_tokens": [2, 2]}},
    ],
)
def test_every_envelope_is_answered_with_predictions(mlflow_servers, body):
    response = invoke(mlflow_servers["chat"], body)
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    assert len(predictions) == 2
    for answer in predictions:
        assert answer["object"] == "chat.completion" and answer["model"] == CHAT_NAME
        assert answer["usage"]["completion_tokens"] == 2


def test_request_fields_override_model_config(mlflow_servers):
    server = mlflow_servers["chat"]
    three = invoke(server, {"messages": MESSAGES, "max_new_tokens": 3}).json()[0]
    assert three["usage"]["completion_tokens"] == 3
    row_wins = invoke(
        server,
        {
            "dataframe_records": [{"messages": MESSAGES, "max_tokens": 1}],
            "params": {"max_tokens": 4},
        },
    ).json()["predictions"][0]
    assert row_wins["usage"]["completion_tokens"] == 1


def test_same_model_over_openai_client(mlflow_servers):
    server = mlflow_servers["chat"]
    client = openai.OpenAI(base_url=server.url("predict_port", "/v1"), api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == [CHAT_NAME]
    chat = client.chat.completions.create(
        model=CHAT_NAME, messages=MESSAGES, max_tokens=LOADED_MAX_NEW_TOKENS, temperature=0
    )
    mlflow_text = invoke(server, {"messages": MESSAGES}).json()[0]["choices"][0]["message"]
    assert chat.choices[0].message.content == mlflow_text["content"]


def test_stop_sequence_is_cut(mlflow_servers):
    server = mlflow_servers["chat"]
    full = invoke(server, {"messages": MESSAGES, "max_tokens": 5}).json()[0]
    text = full["choices"][0]["message"]["content"]
    stop = text[2:4]
    assert stop, text
    cut = invoke(server, {"messages": MESSAGES, "max_tokens": 5, "stop": [stop]}).json()[0]
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "status", "code", "fragment"),
    [
        ({"inputs": {"messages": MESSAGES}, "instances": []}, 400, "BAD_REQUEST", "exactly one"),
        ({"dataframe_records": [{"prompt": "x"}]}, 400, "BAD_REQUEST", "takes 'messages'"),
        ({"messages": MESSAGES, "temperature": 5}, 400, "INVALID_PARAMETER_VALUE", "[0, 2], got 5"),
        ({"messages": MESSAGES, "logit_bias": {}}, 400, "INVALID_PARAMETER_VALUE", "'logit_bias'"),
        ({"messages": "hi"}, 400, "INVALID_PARAMETER_VALUE", "'messages' must be"),
    ],
)
def test_errors_have_mlflow_bodies(mlflow_servers, body, status, code, fragment):
    response = invoke(mlflow_servers["chat"], body)
    assert response.status_code == status, response.text
    assert response.json()["error_code"] == code
    assert fragment in response.json()["message"]


def test_malformed_json_and_content_type(mlflow_servers):
    server = mlflow_servers["chat"]
    with server.client() as client:
        url = server.url("predict_port", "/invocations")
        bad = client.post(url, content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error_code"] == "BAD_REQUEST"
        text = client.post(url, content=b"x", headers={"content-type": "text/plain"})
        assert text.status_code == 415 and "application/json" in text.json()["message"]


def test_embeddings_model_over_invocations(mlflow_servers, mlflow_embed_dir):
    server = mlflow_servers["embed"]
    texts = ["hello world", "the lazy dog"]
    bare = invoke(server, {"input": texts})
    assert bare.status_code == 200, bare.text
    body = bare.json()
    assert body["object"] == "list" and set(body) == {"object", "data", "usage"}
    vectors = torch.tensor([row["embedding"] for row in body["data"]])
    expected = EmbeddingModel(str(mlflow_embed_dir)).embed(texts)
    torch.testing.assert_close(vectors, expected, atol=1e-5, rtol=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    split = invoke(
        server, {"dataframe_split": {"columns": ["input"], "data": [[t] for t in texts]}}
    )
    assert split.json()["predictions"]["data"] == body["data"]


def test_embeddings_server_serves_no_generation(mlflow_servers):
    server = mlflow_servers["embed"]
    client = openai.OpenAI(base_url=server.url("predict_port", "/v1"), api_key="x", max_retries=0)
    result = client.embeddings.create(model=EMBED_NAME, input=["a b c"])
    assert len(result.data[0].embedding) == 32 and result.model == EMBED_NAME
    with server.client() as http:
        infer = http.post(server.url("predict_port", "/infer"), json={"inputs": "x"})
        assert infer.status_code == 404
        assert "embeddings model tiny-org/tiny-embed only" in infer.json()["error"]
        info = http.get(
            server.url("predict_port", "/info"), params={"api-version": "2024-05-01-preview"}
        )
        assert info.json()["model_type"] == "embeddings"


def test_model_without_weights_fails_at_start(mlflow_chat_dir, tmp_path):
    import shutil

    import yaml

    path = shutil.copytree(
        mlflow_chat_dir, tmp_path / "ref", ignore=shutil.ignore_patterns("model")
    )
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    del mlmodel["flavors"]["transformers"]["model_binary"]
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "saved without weights" in done.stderr
