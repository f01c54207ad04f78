"""A service whose streams never end: what the disconnect and HTTP-edge tests share."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import GenerationFailed
from engine.outputs import TokenEvent
from tests.support.door_fakes import AZURE_CHAT, MESSAGES

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

    def count_refusal(self) -> None:
        """Admission's hook for a request refused at the door (nothing counts it here)."""

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
