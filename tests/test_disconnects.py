"""A client that goes away aborts its request on every route, streamed or whole: the predict app
runs under a real uvicorn server over a service whose generations never end by themselves, a raw
socket sends a request and closes mid-generation, and the generation must be closed (what aborts
it on the workers) within a second, with nothing logged as a warning or an error. And
``/invocations``: one failing row cancels the other rows."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from coordinator.errors import GenerationFailed
from engine.outputs import TokenEvent
from tests.door_fakes import AZURE_CHAT, MESSAGES, ScriptedService, predict_app, serving

FAIL = "fail"  # the prompt of a generation that fails after two tokens


@dataclass
class Generation:
    prompt: str
    tokens: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    closed_at: float = 0.0
    ended_by: str = ""  # "cancelled" (CancelledError inside it) or "closed" (aclose at a yield)


class EndlessService:
    """Yields a token every 20 ms until the generation is cancelled or closed (a prompt of
    ``FAIL`` raises GenerationFailed after two tokens); records each generation."""

    def __init__(self) -> None:
        self.generations: list[Generation] = []
        self._ids = itertools.count()
        self.in_flight, self.max_requests, self.draining = 0, 100, False  # admission

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(self, request: Any):
        generation = Generation("".join(map(chr, request.prompt_token_ids)))
        self.generations.append(generation)
        generation.started.set()
        try:
            for i in itertools.count():
                if generation.prompt == FAIL and i == 2:
                    raise GenerationFailed("worker lost")
                await asyncio.sleep(0.02)
                generation.tokens += 1
                now = time.monotonic()
                yield TokenEvent(request.request_id, 10 + i, "a", request.num_prompt_tokens, i, now)
        except asyncio.CancelledError:
            generation.ended_by = "cancelled"
            raise
        except GeneratorExit:
            generation.ended_by = "closed"
            raise
        finally:
            generation.closed_at = time.monotonic()
            generation.closed.set()


@pytest.fixture
def served() -> Iterator[tuple[str, EndlessService]]:
    service = EndlessService()
    with serving(predict_app(service)) as url:
        yield url, service


def send_request(url: str, path: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {received!r}"
        received += chunk
    return received


STREAMS = [
    ("/infer", {"inputs": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    (AZURE_CHAT, {"messages": MESSAGES, "stream": True}),
    ("/generate_stream", {"inputs": "hi"}),
    ("/", {"inputs": "hi", "stream": True}),
]
WHOLE = [
    ("/infer", {"inputs": "hi"}),
    ("/infer_token", {"input_id": [104, 105]}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "hi"}),
    (AZURE_CHAT, {"messages": MESSAGES}),
    ("/generate", {"inputs": "hi"}),
    ("/", {"inputs": "hi"}),
    ("/invocations", {"messages": MESSAGES}),
    ("/invocations", {"dataframe_records": [{"messages": MESSAGES}] * 3}),
]


def assert_all_closed_soon(service: EndlessService, left_at: float, count: int) -> None:
    assert len(service.generations) == count
    for generation in service.generations:
        assert generation.closed.wait(2), "the generation went on after the client left"
        assert generation.closed_at - left_at < 1.0
        assert generation.ended_by in ("cancelled", "closed")


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
