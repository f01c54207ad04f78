"""Embeddings: OpenAI ``POST /v1/embeddings`` and Azure ``POST /embeddings`` (also under
``/models``), served by the cluster's embedding worker.

``encoding_format``: ``float`` (default) or ``base64`` (little-endian float32 bytes; the openai
client asks for it by default). ``input_type`` is accepted (the model has a single mode).
``dimensions`` other than the model's own cannot be honoured: OpenAI answers 400, Azure 422
``parameter_not_supported``. Errors use each API's own body. Requests are admitted like
generations (:mod:`~coordinator.api.admission`): 429 past ``max_requests``, 503 while draining.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api import azure, openai
from coordinator.api.admission import Admission, admitted
from coordinator.api.azure import PREFIXES, check_api_version, not_supported, split_extras
from coordinator.api.common import create_router, read_object
from coordinator.api.errors import APIError, OpenAIError
from coordinator.api.limits import MAX_EMBEDDING_CHARS, MAX_EMBEDDING_INPUTS, count_over, over_limit
from coordinator.api.openai import openai_routes
from coordinator.errors import ServiceError

MAX_INPUTS = MAX_EMBEDDING_INPUTS
AZURE_KEYS = {"input", "dimensions", "encoding_format", "input_type", "model"}
ENCODINGS = ("float", "base64")

Embed = Callable[[list[str]], Awaitable[dict[str, Any]]]  # texts -> {"embeddings", "tokens"}


def _inputs(body: dict) -> list[str]:
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and (over := count_over("input", "texts", texts, MAX_INPUTS)):
        raise OpenAIError(422, over, "input")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise OpenAIError(
            400,
            f"'input' must be a non-empty string or a list of 1 to {MAX_INPUTS} non-empty strings",
            "input",
        )
    for index, text in enumerate(texts):
        if len(text) > MAX_EMBEDDING_CHARS:
            name = f"input[{index}]" if isinstance(value, list) else "input"
            raise OpenAIError(
                422, over_limit(name, "characters", MAX_EMBEDDING_CHARS, len(text)), "input"
            )
    return texts


def _encode(vector: Any, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embedded(
    embed: Embed, service: Admission | None, texts: list[str], encoding: str = "float"
) -> tuple[list[dict], dict[str, int]]:
    """OpenAI's ``data`` and ``usage`` of the embeddings of ``texts``, computed once ``service``
    admits them like a generation."""
    async with admitted(service):
        result = await embed(texts)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, encoding)}
        for i, row in enumerate(result["embeddings"])
    ]
    tokens = sum(result["tokens"])
    return data, {"prompt_tokens": tokens, "total_tokens": tokens}


@dataclass(eq=False)
class EmbeddingRoutes:
    """The two embeddings handlers over the embedding worker; ``service`` (its ``in_flight``,
    ``max_requests`` and ``draining``) admits them like generations."""

    embed: Embed
    model_name: str
    dimensions: int
    body_limit_mb: int
    service: Admission | None = None

    async def openai_embeddings(self, request: Request) -> Response:
        try:
            body = await read_object(request, self.body_limit_mb)
            texts, encoding = _inputs(body), self._openai_encoding(body)
            data, usage = await embedded(self.embed, self.service, texts, encoding)
        except APIError as exc:
            return openai.error_response(exc)
        except ServiceError as exc:
            return openai.service_error_response(APIError.from_service(exc))
        answer = {"object": "list", "data": data, "model": self.model_name, "usage": usage}
        return JSONResponse(answer)

    async def azure_embeddings(self, request: Request) -> Response:
        try:
            check_api_version(request)
            body = await read_object(request, self.body_limit_mb)
            split_extras(request, body, AZURE_KEYS, pass_through=frozenset())
            encoding = self._azure_encoding(body)
            texts = _inputs(body)
            data, usage = await embedded(self.embed, self.service, texts, encoding)
        except APIError as exc:
            return azure.error_response(exc)
        except ServiceError as exc:
            return azure.error_response(APIError.from_service(exc))
        answer = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "model": self.model_name}
        return JSONResponse({**answer, "data": data, "usage": usage})

    def _openai_encoding(self, body: dict) -> str:
        encoding = body.get("encoding_format") or "float"
        if encoding not in ENCODINGS:
            raise OpenAIError(
                400,
                f"'encoding_format' must be float or base64, got {json.dumps(encoding)}",
                "encoding_format",
            )
        if body.get("dimensions") not in (None, self.dimensions):
            raise OpenAIError(
                400, f"'dimensions' must be {self.dimensions} for {self.model_name}", "dimensions"
            )
        return encoding

    def _azure_encoding(self, body: dict) -> str:
        encoding = body.get("encoding_format") or "float"
        if encoding not in ENCODINGS:
            raise not_supported("encoding_format", encoding)
        if body.get("dimensions") not in (None, self.dimensions):
            raise not_supported("dimensions", body["dimensions"])
        return encoding


def create_embeddings_router(routes: EmbeddingRoutes) -> APIRouter:
    azure_routes = (
        ("POST", f"{prefix}/embeddings", routes.azure_embeddings) for prefix in PREFIXES
    )
    openai_route = ("POST", "/v1/embeddings", routes.openai_embeddings)
    return create_router(*openai_routes(openai_route), *azure_routes)
