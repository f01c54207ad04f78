"""A client that goes away aborts its request on every route, streamed or whole: the predict app
runs under a real uvicorn server over a service whose generations never end by themselves, a raw
socket sends a request and closes mid-generation, and the generation must be closed (what aborts
it on the workers) within a second, with nothing logged as a warning or an error. And
``/invocations``: one failing row cancels the other rows."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.door_fakes import ScriptedService, predict_app, serving
from tests.support.endless_service import (
    FAIL,
    STREAMS,
    WHOLE,
    EndlessService,
    assert_all_closed_soon,
    read_until,
    send_request,
)


@pytest.fixture
def served() -> Iterator[tuple[str, EndlessService]]:
    service = EndlessService()
    with serving(predict_app(service)) as url:
        yield url, service


@pytest.mark.parametrize(("path", "body"), STREAMS)
def test_stream_disconnect_closes_the_generation(served, caplog, path, body):
    url, service = served
    caplog.set_level(logging.WARNING)
    sock = send_request(url, path, body)
    received = read_until(sock, b"data:")
    assert received.startswith(b"HTTP/1.1 200 OK")
    generation = service.generations[0]
    assert not generation.closed.is_set()
    sock.close()
    assert_all_closed_soon(service, time.monotonic(), 1)
    time.sleep(0.2)  # anything the server would log about the disconnect
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(("path", "body"), WHOLE)
def test_whole_answer_disconnect_closes_the_generation(served, caplog, path, body):
    url, service = served
    caplog.set_level(logging.WARNING)
    sock = send_request(url, path, body)
    rows = len(body.get("dataframe_records", [None]))
    deadline = time.monotonic() + 5
    while len(service.generations) < rows or any(g.tokens < 3 for g in service.generations):
        assert time.monotonic() < deadline, "the generations did not start"
        time.sleep(0.01)
    assert not any(g.closed.is_set() for g in service.generations)
    sock.close()
    assert_all_closed_soon(service, time.monotonic(), rows)
    time.sleep(0.2)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_one_failing_row_cancels_the_other_rows(served):
    url, service = served
    rows = [{"messages": [{"role": "user", "content": p}]} for p in ("slow", FAIL, "slower")]
    response = httpx.post(f"{url}/invocations", json={"dataframe_records": rows}, timeout=5)
    assert response.status_code == 500
    assert response.json() == {"error_code": "INTERNAL_ERROR", "message": "worker lost"}
    by_prompt = {g.prompt: g for g in service.generations}
    assert set(by_prompt) == {"slow", FAIL, "slower"}
    for prompt in ("slow", "slower"):  # cancelled before the answer went out
        assert by_prompt[prompt].closed.is_set() and by_prompt[prompt].ended_by == "cancelled"


@pytest.mark.parametrize("path", ["/infer", "/v1/completions", "/generate", "/invocations"])
def test_client_that_leaves_while_sending_its_body_is_not_an_error(served, caplog, path):
    url, service = served
    caplog.set_level(logging.WARNING)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"inputs": "')
        time.sleep(0.2)  # the handler waits for the rest of the body
    time.sleep(0.3)
    assert service.generations == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_answers_that_complete_are_not_cut_on_a_kept_alive_connection():
    big = {"inputs": "hi", "parameters": {"padding": "x" * 600_000}}  # many body messages
    with serving(predict_app(ScriptedService(5))) as url, httpx.Client(base_url=url) as client:
        for _ in range(2):
            whole = client.post("/infer", json=big)
            assert whole.status_code == 200 and whole.json() == {"generated_text": "ababa"}
            stream = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
            assert stream.status_code == 200 and stream.content.endswith(b"data: [DONE]\n\n")
            texts = [
                json.loads(line[6:])["choices"][0]["text"]
                for line in stream.content.split(b"\n\n")[:-2]
            ]
            assert "".join(texts) == "ababa"
