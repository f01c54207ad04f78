"""A predict app over a scripted service, in process or on a real port: what the door tests
(and the HTTP edge benchmark) drive the front doors with, no cluster behind them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from coordinator.api.app import create_predict_app
from coordinator.door_limits import DEFAULT_DOOR_LIMITS, DoorLimits
from coordinator.errors import ServiceError
from coordinator.model_info import ModelInfo
from coordinator.served_model import ServedModels
from engine.outputs import TokenEvent
from engine.request import FinishReason

AZURE_CHAT = "/chat/completions?api-version=2024-05-01-preview"
MESSAGES = [{"role": "user", "content": "hi"}]


class CharTokenizer:
    """One token per character (its code point); chat renders the last message's content."""

    all_special_ids = [0]

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = True, **_: Any
    ) -> list[int] | str:
        text = messages[-1]["content"]
        return self.encode(text) if tokenize else text


class ScriptedService:
    """Yields ``tokens`` events ("a", "b", ...), then raises ``error``; without an error the last
    event finishes with ``finish`` (an ``error`` finish carries the text "engine failed"), and
    with ``finish`` None the generation just stops."""

    def __init__(
        self,
        tokens: int,
        error: ServiceError | None = None,
        finish: FinishReason | None = FinishReason.LENGTH,
    ) -> None:
        self.tokens, self.error, self.finish = tokens, error, finish
        self.in_flight, self.max_requests, self.draining = 0, 100, False  # admission's state
        self.requests: list[Any] = []  # every GenerationRequest it was given
        self.refusals = 0  # requests refused at the door or by their client's limits

    def count_refusal(self) -> None:
        """The hook for a request refused before it reached the service."""
        self.refusals += 1

    def new_request_id(self) -> str:
        return "req-1"

    async def generate(self, request: Any):
        self.requests.append(request)
        for i in range(self.tokens):
            last = self.error is None and i == self.tokens - 1
            finish = self.finish if last else None
            error = "engine failed" if finish == FinishReason.ERROR else None
            now = time.monotonic()
            n = request.num_prompt_tokens
            yield TokenEvent(request.request_id, 10 + i, "ab"[i % 2], n, i + 1, now, finish, error)
        if self.error is not None:
            raise self.error


class EngineService:
    """Runs each request on the tiny engine in process (one at a time), or, with ``script``
    set, answers its text in pieces of 3 characters."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.script = engine, ""
        self.lock = asyncio.Lock()
        self.ids = iter(range(10**9))
        self.in_flight, self.max_requests, self.draining = 0, 100, False  # admission's state

    def count_refusal(self) -> None:
        """The hook for a request refused before it reached the service (none here)."""

    def new_request_id(self) -> str:
        return f"req-{next(self.ids)}"

    async def generate(self, request: Any):
        if self.script:
            pieces = [self.script[i : i + 3] for i in range(0, len(self.script), 3)]
            for i, piece in enumerate(pieces):
                finish = FinishReason.STOP if i == len(pieces) - 1 else None
                n = request.num_prompt_tokens
                yield TokenEvent(request.request_id, 7, piece, n, i + 1, time.monotonic(), finish)
            return
        async with self.lock:
            rid = request.request_id
            self.engine.add_request(
                self.engine.request(rid, list(request.prompt_token_ids), request.params)
            )
            try:
                while rid in self.engine.requests:
                    for event in self.engine.step():
                        if event.request_id == rid:
                            yield event
                    await asyncio.sleep(0)
            finally:
                self.engine.abort(rid)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
"""The tool doors' argument schema: a bounded string and a bounded integer."""
TOOL_CALL_SCRIPT = (
    "Checking.\n<tool_call>"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
)
"""A model's text with one ``get_weather`` call in Hermes' tags, for ``EngineService.script``."""


@contextlib.contextmanager
def engine_door(engine: Any, api_keys: tuple[str, ...] = ()) -> Iterator[tuple[str, EngineService]]:
    """The predict app over ``engine`` (served as model "tiny") under uvicorn: its URL and its
    :class:`EngineService`."""
    service = EngineService(engine)
    tokenizer = engine.tokenizer
    model = ModelInfo("tiny", tokenizer, 1024, len(tokenizer), 1000)
    served = ServedModels(generation=model, embedding_path=None)
    app = create_predict_app(service, served, None, body_limit_mb=2, api_keys=api_keys,
                             is_ready=lambda: True)  # fmt: skip
    with serving(app) as url:
        yield url, service


async def no_embeddings(texts: list[str]) -> dict[str, Any]:
    raise AssertionError("this predict app serves no embedding model")


def predict_app(
    service: Any,
    body_limit_mb: int = 1,
    door_limits: DoorLimits = DEFAULT_DOOR_LIMITS,
    api_keys: tuple[str, ...] = (),
    shared_responses: Any = None,
):
    model = ModelInfo("fake", CharTokenizer(), 1024, 1000, 100)
    served = ServedModels(generation=model, embedding_path=None)
    return create_predict_app(
        service,
        served,
        no_embeddings,
        body_limit_mb=body_limit_mb,
        api_keys=api_keys,
        is_ready=lambda: True,
        door_limits=door_limits,
        shared_responses=shared_responses,
    )


def post(app: Any, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            return await client.post(path, json=body, **kwargs)

    return asyncio.run(run())


@contextlib.contextmanager
def serving(app: Any, **options: Any) -> Iterator[str]:
    """``app`` under a real uvicorn server on a free port, in a thread; yields its base URL.
    ``options``: more ``uvicorn.Config`` arguments (the edge's limits)."""
    config = uvicorn.Config(  # log_config None: uvicorn's records reach pytest's caplog
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
        log_config=None,
        **options,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def events(response: httpx.Response) -> list[bytes]:
    """The SSE events of a stream, each with its ``data:`` prefix."""
    assert response.content.endswith(b"\n\n"), response.content
    return response.content[:-2].split(b"\n\n")


# (door, path, a body it takes): one generation route of each door and kind (stream or not)
DOORS = [
    ("mindie", "/infer", {"inputs": "hi"}),
    ("openai", "/v1/chat/completions", {"messages": MESSAGES}),
    ("openai", "/v1/completions", {"prompt": "hi", "stream": True}),
    ("azure", AZURE_CHAT, {"messages": MESSAGES}),
    ("tgi", "/generate", {"inputs": "hi"}),
    ("tgi", "/generate_stream", {"inputs": "hi"}),
    ("mlflow", "/invocations", {"messages": MESSAGES}),
]
