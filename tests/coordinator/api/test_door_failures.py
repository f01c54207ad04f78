"""What each front door's client sees when a request cannot be completed: the protocol's error
status and body before the first byte, the door's own last error event after it (never a normal
finish), and an error status instead of a partial whole answer. The predict app runs in process
over a scripted service; the official clients (openai, azure-ai-inference, text-generation) are
driven against it too."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
import text_generation
from azure.ai.inference import ChatCompletionsClient
from azure.ai.inference.models import UserMessage
from azure.core.credentials import AzureKeyCredential
from azure.core.exceptions import HttpResponseError

from coordinator.errors import ConstraintViolated, GenerationFailed, NoWorkerError
from engine.request import FinishReason
from tests.support.door_fakes import (
    AZURE_CHAT,
    MESSAGES,
    ScriptedService,
    events,
    post,
    predict_app,
    serving,
)


# (door, path, body): every generation route, streamed or not
def routes(stream: bool) -> list[tuple[str, str, dict]]:
    mindie = {"inputs": "hi", "stream": stream, "parameters": {"seed": 7}}
    tgi = {"inputs": "hi", "parameters": {"seed": 7}}
    found = [
        ("mindie", "/infer", mindie),
        ("mindie", "/infer_token", {"input_id": [104, 105], "stream": stream}),
        ("openai", "/v1/completions", {"prompt": "hi", "stream": stream}),
        ("openai", "/v1/chat/completions", {"messages": MESSAGES, "stream": stream}),
        ("azure", AZURE_CHAT, {"messages": MESSAGES, "stream": stream}),
        ("azure", "/models" + AZURE_CHAT, {"messages": MESSAGES, "stream": stream}),
        ("tgi", "/", {**tgi, "stream": stream}),
        ("tgi", "/generate_stream" if stream else "/generate", tgi),
        (
            "anthropic",
            "/v1/messages",
            {"messages": MESSAGES, "max_tokens": 8, "model": "m", "stream": stream},
        ),  # fmt: skip
        ("openai", "/v1/responses", {"input": "hi", "model": "m", "stream": stream}),
    ]
    if not stream:
        found.append(("mlflow", "/invocations", {"messages": MESSAGES}))
    return found


STREAMED, WHOLE = routes(True), routes(False)

NO_PAIR = {  # NoWorkerError("no pair can take it"), as each door answers it
    "mindie": {
        "error": "Service Unavailable: no pair can take it",
        "error_type": "Service Unavailable",
    },
    "openai": {
        "error": {
            "message": "no pair can take it",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    },
    "azure": {"error": {"code": "NoWorkerError", "message": "no pair can take it"}},
    "tgi": {"error": "no pair can take it", "error_type": "overloaded"},
    "mlflow": {"error_code": "TEMPORARILY_UNAVAILABLE", "message": "no pair can take it"},
    "anthropic": {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "no pair can take it"},
    },
}
WORKER_LOST = {  # GenerationFailed("worker lost"), as each door answers it before any byte
    "mindie": {
        "error": "Incomplete Generation: worker lost",
        "error_type": "Incomplete Generation",
    },
    "openai": {
        "error": {"message": "worker lost", "type": "server_error", "param": None, "code": None}
    },
    "azure": {"error": {"code": "GenerationFailed", "message": "worker lost"}},
    "tgi": {"error": "worker lost", "error_type": "generation"},
    "mlflow": {"error_code": "INTERNAL_ERROR", "message": "worker lost"},
    "anthropic": {"type": "error", "error": {"type": "api_error", "message": "worker lost"}},
}


@pytest.mark.parametrize(("door", "path", "body"), STREAMED + WHOLE)
def test_failure_before_the_first_byte_is_the_error_status(door, path, body):
    response = post(
        predict_app(ScriptedService(0, NoWorkerError("no pair can take it"))), path, body
    )
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json() == NO_PAIR[door]


@pytest.mark.parametrize(("door", "path", "body"), WHOLE)
def test_whole_answer_that_fails_midway_is_an_error_not_partial_text(door, path, body):
    response = post(predict_app(ScriptedService(3, GenerationFailed("worker lost"))), path, body)
    assert response.status_code == 500
    assert response.json() == WORKER_LOST[door]


@pytest.mark.parametrize(("door", "path", "body"), STREAMED + WHOLE)
def test_a_constraint_violation_is_422_in_each_doors_shape(door, path, body):
    """The output cannot follow the request's grammar: the client's spec, not a server fault."""
    message = "request r failed: constraint_violated: Too many items"
    response = post(predict_app(ScriptedService(0, ConstraintViolated(message))), path, body)
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/json"
    assert message in response.text and "worker lost" not in response.text


def _mindie_failure(error: str, error_type: str, tokens: int) -> dict:
    return {
        "prefill_time": None,
        "decode_time": None,
        "generated_text": "",
        "details": {
            "finish_reason": "stop_sequence",
            "generated_tokens": tokens,
            "seed": 7,
            "cached_tokens": 0,
        },
        "token": None,
        "error": error,
        "error_type": error_type,
    }


@pytest.mark.parametrize("path", ["/infer", "/infer_token"])
def test_mindie_stream_ends_with_stop_sequence_and_the_error(path):
    body = {"stream": True, "parameters": {"seed": 7}}
    body |= {"inputs": "hi"} if path == "/infer" else {"input_id": [104, 105]}
    response = post(predict_app(ScriptedService(2, GenerationFailed("worker lost"))), path, body)
    assert response.status_code == 200
    sent = [json.loads(event.removeprefix(b"data: ")) for event in events(response)]
    assert [e["token"] for e in sent[:2]] == [{"id": 10, "text": "a"}, {"id": 11, "text": "b"}]
    assert all("error" not in e and "details" not in e for e in sent[:2])
    failure = _mindie_failure("Incomplete Generation: worker lost", "Incomplete Generation", 2)
    assert sent[2] == failure and len(sent) == 3


def test_mindie_stream_failure_keeps_the_status_error_type():
    body = {"inputs": "hi", "stream": True, "parameters": {"seed": 7}}
    service = ScriptedService(1, NoWorkerError("every pair failed"))
    last = events(post(predict_app(service), "/infer", body))[-1]
    expected = _mindie_failure("Service Unavailable: every pair failed", "Service Unavailable", 1)
    assert json.loads(last.removeprefix(b"data: ")) == expected


OPENAI_STREAMS = [
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    (AZURE_CHAT, {"messages": MESSAGES, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), OPENAI_STREAMS)
def test_openai_and_azure_streams_end_with_one_error_chunk(path, body):
    response = post(predict_app(ScriptedService(2, GenerationFailed("worker lost"))), path, body)
    assert response.status_code == 200
    sent = events(response)
    error = {"message": "worker lost", "type": "server_error", "param": None, "code": 500}
    assert json.loads(sent[-1].removeprefix(b"data: ")) == {"error": error}
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in sent[:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert b"data: [DONE]" not in response.content
    text = "".join(
        c["choices"][0].get("text") or c["choices"][0]["delta"].get("content", "") for c in chunks
    )
    assert text == "ab"


@pytest.mark.parametrize("path", ["/generate_stream", "/"])
def test_tgi_stream_ends_with_its_error_event(path):
    body = {"inputs": "hi", "stream": True, "parameters": {"seed": 7}}
    response = post(predict_app(ScriptedService(2, GenerationFailed("worker lost"))), path, body)
    assert response.status_code == 200
    sent = events(response)
    assert sent[-1] == b'data:{"error":"worker lost","error_type":"generation"}'
    tokens = [json.loads(event.removeprefix(b"data:")) for event in sent[:-1]]
    assert [t["token"]["text"] for t in tokens] == ["a", "b"]
    assert all(t["details"] is None and t["generated_text"] is None for t in tokens)


def test_an_error_finish_is_a_failure_at_every_door():
    service = ScriptedService(2, finish=FinishReason.ERROR)
    whole = post(predict_app(service), "/v1/completions", {"prompt": "hi"})
    assert whole.status_code == 500 and whole.json()["error"]["message"] == "engine failed"
    body = {"inputs": "hi", "stream": True, "parameters": {"seed": 7}}
    last = events(post(predict_app(service), "/infer", body))[-1]
    expected = _mindie_failure("Incomplete Generation: engine failed", "Incomplete Generation", 1)
    assert json.loads(last.removeprefix(b"data: ")) == expected


def test_a_generation_that_stops_without_a_finish_is_a_failure():
    service = ScriptedService(2, finish=None)
    whole = post(predict_app(service), "/generate", {"inputs": "hi"})
    assert whole.status_code == 500
    assert whole.json() == {
        "error": "the generation ended without a finish",
        "error_type": "generation",
    }


def test_an_abort_finish_is_never_a_normal_finish():
    whole = post(
        predict_app(ScriptedService(1, finish=FinishReason.ABORT)), "/infer", {"inputs": "hi"}
    )
    assert whole.status_code == 500
    assert whole.json()["error"] == "Incomplete Generation: the request was aborted"


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_the_limit_is_413_while_it_is_read(chunked):
    big = json.dumps({"inputs": "x" * (1024 * 1024)}).encode()

    async def pieces():  # no Content-Length: the limit is found while reading
        yield big[:1000]
        yield big[1000:]

    content: Any = pieces() if chunked else big

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=predict_app(ScriptedService(1)))
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            return await client.post("/infer", content=content)

    response = asyncio.run(run())
    assert response.status_code == 413
    size = "more than 1048576 bytes" if chunked else f"{len(big)} bytes"
    assert response.json() == {
        "error": f"request body of {size} is over the limit of 1 MB",
        "error_type": "Payload Too Large",
    }


def test_a_normal_whole_answer_still_works():
    response = post(predict_app(ScriptedService(3)), "/infer", {"inputs": "hi"})
    assert response.status_code == 200 and response.json() == {"generated_text": "aba"}


# ---- the official clients -----------------------------------------------------------------------


def _openai_client(app: Any) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(
        base_url="http://door/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport),
    )


def test_openai_client_raises_on_a_stream_that_fails():
    async def run() -> list[str]:
        client = _openai_client(predict_app(ScriptedService(2, GenerationFailed("worker lost"))))
        stream = await client.chat.completions.create(model="fake", messages=MESSAGES, stream=True)
        pieces = []
        with pytest.raises(openai.APIError, match="^worker lost$"):
            async for chunk in stream:
                assert chunk.choices[0].finish_reason is None
                pieces.append(chunk.choices[0].delta.content or "")
        return pieces

    assert "".join(asyncio.run(run())) == "ab"


def test_openai_client_gets_the_status_of_a_whole_answer_that_fails():
    async def run() -> None:
        client = _openai_client(predict_app(ScriptedService(2, GenerationFailed("worker lost"))))
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model="fake", prompt="hi")
        assert failed.value.status_code == 500 and failed.value.message.endswith("worker lost")
        client = _openai_client(predict_app(ScriptedService(0, NoWorkerError("no pair"))))
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model="fake", messages=MESSAGES, stream=True)
        assert refused.value.status_code == 503

    asyncio.run(run())


def test_azure_and_tgi_clients_never_see_a_normal_finish():
    with serving(predict_app(ScriptedService(2, GenerationFailed("worker lost")))) as url:
        azure = ChatCompletionsClient(endpoint=url, credential=AzureKeyCredential("unused"))
        updates = list(azure.complete(messages=[UserMessage("hi")], stream=True))
        assert "".join(u.choices[0].delta.content or "" for u in updates) == "ab"
        assert all(u.choices[0].finish_reason is None for u in updates)
        with pytest.raises(HttpResponseError) as failed:
            azure.complete(messages=[UserMessage("hi")])
        assert failed.value.status_code == 500

        tgi = text_generation.Client(url)
        received = []
        with pytest.raises(text_generation.errors.GenerationError, match="^worker lost$"):
            for response in tgi.generate_stream("hi"):
                assert response.details is None
                received.append(response.token.text)
        assert received == ["a", "b"]
        with pytest.raises(text_generation.errors.GenerationError, match="^worker lost$"):
            tgi.generate("hi")
