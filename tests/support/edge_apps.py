"""Apps behind the HTTP edge's limits: what the edge and fuzz tests share."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import torch

from coordinator.api.app import create_predict_app
from coordinator.api.limits import (
    MAX_STOP_CHARS,
    prompt_char_limit,
)
from coordinator.content_safety import ContentFilter
from coordinator.model_info import ModelInfo
from coordinator.served_model import ServedModels
from tests.support.door_fakes import AZURE_CHAT, MESSAGES, CharTokenizer, ScriptedService

AZURE_EMBED = "/embeddings?api-version=2024-05-01-preview"


MAX_INPUT_TOKENS = 100


FILTER = ContentFilter.from_config(
    {"enabled": True, "categories": {"test": {"terms": ["forbidden"]}}}
)


class DecodingTokenizer(CharTokenizer):
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class AdmittingService(ScriptedService):
    """A scripted service with the admission state the service keeps."""

    def __init__(self, max_requests: int = 100) -> None:
        super().__init__(2)
        self.in_flight, self.max_requests, self.draining = 0, max_requests, False


async def fake_embed(texts: list[str]) -> dict[str, Any]:
    return {"embeddings": [torch.zeros(4) for _ in texts], "tokens": [1] * len(texts)}


def app_for(
    service: Any = None, content_filter: Any = None, body_limit_mb: int = 1, tokenizer: Any = None
) -> Any:
    service = service or AdmittingService()
    tokenizer = tokenizer or DecodingTokenizer()
    model = ModelInfo("fake", tokenizer, 1024, 1000, MAX_INPUT_TOKENS)
    model.content_filter = content_filter
    served = ServedModels(model, "embedder", "embedder", 4)
    return create_predict_app(
        service,
        served,
        fake_embed,
        body_limit_mb=body_limit_mb,
        api_keys=(),
        is_ready=lambda: True,
    )


def post(app: Any, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://door") as client:
            return await client.post(path, json=body, **kwargs)

    return asyncio.run(run())


def message_of(response: httpx.Response) -> str:
    """The error message, whatever the door's shape."""
    body = response.json()
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(body.get("message", error))


MANY_STOPS = ["s"] * 10_000


LONG_STOP = ["x" * (MAX_STOP_CHARS + 1)]


STOP_ROUTES = [  # (path, body with the stop list in it)
    ("/v1/completions", lambda stop: {"prompt": "hi", "stop": stop}),
    ("/v1/chat/completions", lambda stop: {"messages": MESSAGES, "stop": stop}),
    (AZURE_CHAT, lambda stop: {"messages": MESSAGES, "stop": stop}),
    ("/generate", lambda stop: {"inputs": "hi", "parameters": {"stop": stop}}),
    ("/", lambda stop: {"inputs": "hi", "parameters": {"stop": stop}}),
    ("/invocations", lambda stop: {"messages": MESSAGES, "stop": stop}),
]


class BrokenService(AdmittingService):
    def new_request_id(self) -> str:
        raise RuntimeError("ray.exceptions.RayTaskError: Traceback (most recent call last) ...")


class FailingEventsService(AdmittingService):
    async def generate(self, request: Any):
        raise KeyError("worker internals")
        yield  # an async generator


CHAR_CAP = prompt_char_limit(MAX_INPUT_TOKENS)  # 16 for each prompt token: 1600


LONG = "x" * (CHAR_CAP + 1)


HALF = "x" * (CHAR_CAP // 2 + 1)


LONG_PROMPTS = [
    ("/infer", {"inputs": LONG}, "inputs"),
    ("/infer", {"inputs": [{"type": "text", "text": HALF}] * 2}, "inputs"),
    ("/v1/tokenizer", {"inputs": LONG}, "inputs"),
    ("/generate", {"inputs": LONG}, "inputs"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": [LONG]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HALF}] * 2}, "messages"),
    (AZURE_CHAT, {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    (
        "/invocations",
        {"dataframe_records": [{"messages": [MESSAGES[0], {"role": "user", "content": LONG}]}]},
        "messages",
    ),
]


class CountingTokenizer(DecodingTokenizer):
    calls = 0

    def encode(self, text: str) -> list[int]:
        CountingTokenizer.calls += 1
        return super().encode(text)

    def apply_chat_template(self, messages: list[dict], **options: Any) -> list[int]:
        CountingTokenizer.calls += 1
        return super().apply_chat_template(messages, **options)
