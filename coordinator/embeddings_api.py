"""Embeddings: OpenAI ``POST /v1/embeddings`` and Azure ``POST /embeddings`` (also under
``/models``), served by the cluster's embedding worker.

``encoding_format``: ``float`` (default) or ``base64`` (little-endian float32 bytes; the openai
client asks for it by default). ``input_type`` is accepted (the model has a single mode).
``dimensions`` other than the model's own cannot be honoured.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from coordinator.azure_api import (
    AzureError,
    _error,
    check_api_version,
    not_supported,
    split_extras,
)
from coordinator.infer_api import APIError, read_json
from coordinator.openai_api import OpenAIError

MAX_INPUTS = 2048
AZURE_KEYS = {"input", "dimensions", "encoding_format", "input_type", "model"}


def _inputs(body: dict) -> list[str]:
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if (
        not isinstance(texts, list)
        or not texts
        or len(texts) > MAX_INPUTS
        or not all(isinstance(t, str) and t for t in texts)
    ):
        raise ValueError(
            f"'input' must be a non-empty string or a list of 1 to {MAX_INPUTS} non-empty strings"
        )
    return texts


def _encode(vector: Any, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def create_embeddings_router(
    cluster: Any, model_name: str, dimensions: int, body_limit_mb: int
) -> APIRouter:
    router = APIRouter()

    async def run(texts: list[str], encoding: str) -> tuple[list[dict], dict[str, int]]:
        result = await cluster.embed(texts)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(row, encoding)}
            for i, row in enumerate(result["embeddings"])
        ]
        tokens = sum(result["tokens"])
        return data, {"prompt_tokens": tokens, "total_tokens": tokens}

    @router.post("/v1/embeddings")
    async def openai_embeddings(request: Request) -> Response:
        try:
            body = await read_json(request, body_limit_mb)
            if not isinstance(body, dict):
                raise OpenAIError(400, "the request body must be a JSON object")
            texts = _inputs(body)
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise OpenAIError(
                    400,
                    f"'encoding_format' must be float or base64, got {json.dumps(encoding)}",
                    "encoding_format",
                )
            if body.get("dimensions") not in (None, dimensions):
                raise OpenAIError(
                    400, f"'dimensions' must be {dimensions} for {model_name}", "dimensions"
                )
        except ValueError as exc:
            return OpenAIError(400, str(exc), "input").response()
        except APIError as exc:
            return OpenAIError(exc.status, exc.message).response()
        except OpenAIError as exc:
            return exc.response()
        data, usage = await run(texts, encoding)
        return JSONResponse({"object": "list", "data": data, "model": model_name, "usage": usage})

    async def azure_embeddings(request: Request) -> Response:
        try:
            check_api_version(request)
            body = await read_json(request, body_limit_mb)
            if not isinstance(body, dict):
                raise _error(400, "BadRequest", "the request body must be a JSON object")
            split_extras(request, body, AZURE_KEYS, pass_through=frozenset())
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise not_supported("encoding_format", encoding)
            if body.get("dimensions") not in (None, dimensions):
                raise not_supported("dimensions", body["dimensions"])
            texts = _inputs(body)
        except ValueError as exc:
            return _error(400, "BadRequest", str(exc)).response()
        except AzureError as exc:
            return exc.response()
        except APIError as exc:
            return _error(exc.status, "BadRequest", exc.message).response()
        data, usage = await run(texts, encoding)
        return JSONResponse(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "model": model_name,
                "data": data,
                "usage": usage,
            }
        )

    for prefix in ("", "/models"):
        router.add_api_route(f"{prefix}/embeddings", azure_embeddings, methods=["POST"])
    return router
