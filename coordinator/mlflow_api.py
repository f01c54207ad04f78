"""MLflow's scoring server: ``POST /invocations``, ``GET /ping``, ``/health``, ``/version``.

The served task is the MLflow model's ``inference_task`` (``llm/v1/chat`` for any other model).
Chat and completions rows are generated concurrently through the cluster; embeddings go to the
embedding worker in one call. Answers are MLflow's: a list of ``chat.completion`` /
``text_completion`` objects, or one ``{object: "list", data, usage}`` for embeddings; wrapped in
``{"predictions": ...}`` unless the body was the unified LLM body. Errors are
``{"error_code", "message"}``.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from coordinator.errors import NoWorkerError, RequestTimeout, ServiceError, TooManyRequests
from coordinator.infer_api import APIError, ModelInfo, read_json
from coordinator.inference import InferenceService
from coordinator.mlflow_inputs import (
    MlflowError,
    Scoring,
    embedding_texts,
    generation_params,
    merged_settings,
    parse_scoring,
)
from coordinator.openai_api import (
    OpenAIError,
    _Completion,
    _prompt_ids,
    collect,
    input_blocked,
)
from engine.model.mlflow_model import MlflowModel
from engine.worker_contracts import GenerationRequest

log = logging.getLogger(__name__)
SERVICE_CODES = {
    TooManyRequests: (429, "RESOURCE_EXHAUSTED"),
    RequestTimeout: (408, "DEADLINE_EXCEEDED"),
    NoWorkerError: (503, "TEMPORARILY_UNAVAILABLE"),
}


class MlflowScorer:
    """Runs one parsed scoring request for the served task."""

    def __init__(
        self,
        task: str,
        model_config: dict[str, Any],
        service: InferenceService | None,
        model: ModelInfo | None,
        embed: Any = None,  # async (texts) -> {"embeddings", "tokens"}
    ) -> None:
        self.task, self.model_config = task, model_config
        self.service, self.model, self.embed = service, model, embed
        self.saved_keys = frozenset(model_config)

    async def predict(self, scoring: Scoring) -> Any:
        if self.task == "llm/v1/embeddings":
            return await self._embeddings(scoring)
        settings = merged_settings(self.model_config, scoring.settings)
        params = generation_params(settings, self.task, self.model.vocab_size, self.saved_keys)
        return list(await asyncio.gather(*(self._generate(i, params) for i in scoring.inputs)))

    async def _generate(self, value: Any, params: Any) -> dict[str, Any]:
        kind = "chat" if self.task == "llm/v1/chat" else "text"
        body = {"messages": value} if kind == "chat" else {"prompt": value}
        try:
            ids = await _prompt_ids(body, kind, self.model)
        except OpenAIError as exc:
            raise MlflowError(exc.message, "INVALID_PARAMETER_VALUE") from exc
        if input_blocked(self.model, body, kind):
            raise MlflowError("The input was filtered by the content safety policy")
        answer = _Completion(kind, self.model.name, len(ids), self.model.content_filter)
        await collect(
            self.service.generate(GenerationRequest(self.service.new_request_id(), ids, params)),
            answer,
        )
        return answer.body()

    async def _embeddings(self, scoring: Scoring) -> dict[str, Any]:
        unknown = sorted(set(scoring.settings) - {"encoding_format"})
        if unknown or scoring.settings.get("encoding_format", "float") != "float":
            name = unknown[0] if unknown else "encoding_format"
            raise MlflowError(
                f"unsupported parameter {name!r} for llm/v1/embeddings", "INVALID_PARAMETER_VALUE"
            )
        texts = embedding_texts(scoring.inputs)
        result = await self.embed(texts)
        tokens = sum(result["tokens"])
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": row.tolist()}
                for i, row in enumerate(result["embeddings"])
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def create_mlflow_router(
    scorer: MlflowScorer, mlflow: MlflowModel | None, body_limit_mb: int
) -> APIRouter:
    router = APIRouter()
    server_version = mlflow.mlflow_version if mlflow and mlflow.mlflow_version else None

    @router.post("/invocations")
    async def invocations(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        if content_type != "application/json":
            return _error(
                MlflowError(
                    "This predictor only supports the following content types: "
                    f"['application/json']. Got '{content_type}'.",
                    status=415,
                )
            )
        try:
            body = await read_json(request, body_limit_mb)
            scoring = parse_scoring(body, scorer.task)
            prediction = await scorer.predict(scoring)
        except APIError as exc:
            return _error(MlflowError(exc.message, status=exc.status))
        except MlflowError as exc:
            return _error(exc)
        except ServiceError as exc:
            status, code = SERVICE_CODES.get(type(exc), (500, "INTERNAL_ERROR"))
            return _error(MlflowError(str(exc), code, status))
        return JSONResponse(prediction if scoring.bare else {"predictions": prediction})

    async def ping() -> Response:
        return PlainTextResponse("\n")

    async def server_version_text() -> Response:
        return PlainTextResponse(server_version or version("pdserve"))

    router.add_api_route("/ping", ping, methods=["GET"])
    router.add_api_route("/health", ping, methods=["GET"])
    router.add_api_route("/version", server_version_text, methods=["GET"])
    return router


def _error(exc: MlflowError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)
