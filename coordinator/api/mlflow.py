"""MLflow's scoring server: ``POST /invocations``, ``GET /ping``, ``/health``, ``/version``.

The served task is the MLflow model's ``inference_task`` (``llm/v1/chat`` for any other model).
A request's life: the body is read and parsed into rows and settings
(:mod:`~coordinator.api.mlflow_inputs`); chat and completions rows are generated concurrently
through the cluster, as the tasks of one task group, and answered with OpenAI's shapes
(:mod:`~coordinator.api.openai_format`): the first row that fails cancels the others and its error
answers the request (never a partial prediction), and a client that goes away cancels them all.
Embeddings go to the embedding worker in one call. Answers are MLflow's: a list of
``chat.completion`` / ``text_completion`` objects, or one ``{object: "list", data, usage}`` for
embeddings; wrapped in ``{"predictions": ...}`` unless the body was the unified LLM body. Errors
are ``{"error_code", "message"}``.
"""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from coordinator.api.clients import UNLIMITED, Client, client_of
from coordinator.api.common import collect, create_router, read_json
from coordinator.api.embeddings import embedded
from coordinator.api.errors import APIError, MlflowError, OpenAIError, retry_headers
from coordinator.api.limits import MAX_INVOCATION_ROWS, over_limit
from coordinator.api.mlflow_inputs import (
    Scoring,
    embedding_texts,
    generation_params,
    merged_settings,
    parse_scoring,
)
from coordinator.api.openai_format import Completion
from coordinator.api.openai_request import input_blocked, read_prompt
from coordinator.api.tenants import tenant_of
from coordinator.content_safety import INPUT_FILTERED
from coordinator.errors import ServiceError
from coordinator.inference import InferenceService
from coordinator.model_info import ModelInfo
from engine.model.mlflow_model import MlflowModel
from workers.contracts import GenerationRequest

ERROR_CODES = {  # MLflow's names for service failures, by status; any other is INTERNAL_ERROR
    408: "DEADLINE_EXCEEDED",
    429: "RESOURCE_EXHAUSTED",
    503: "TEMPORARILY_UNAVAILABLE",
}


def error_response(error: APIError) -> JSONResponse:
    headers = retry_headers(error)
    if not isinstance(error, MlflowError):
        error = MlflowError(error.message, status=error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def service_error_response(exc: ServiceError) -> JSONResponse:
    error = APIError.from_service(exc)
    code = ERROR_CODES.get(error.status, "INTERNAL_ERROR")
    return error_response(MlflowError(error.message, code, error.status, error.retry_after_s))


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
        # rows run at once, each a request in flight: never more than max_requests of them
        in_flight_limit = service.max_requests if service is not None else MAX_INVOCATION_ROWS
        self.max_rows = min(MAX_INVOCATION_ROWS, in_flight_limit)

    async def predict(self, scoring: Scoring, tenant: str = "", client: Client = UNLIMITED) -> Any:
        """The scoring request's answer; ``tenant``: whose rows they are (api.tenants);
        ``client``: whose token rate each row's generation is metered against (api.clients)."""
        if len(scoring.inputs) > self.max_rows:
            message = over_limit("the input", "rows", self.max_rows, len(scoring.inputs))
            raise MlflowError(message, "INVALID_PARAMETER_VALUE", 422)
        if self.task == "llm/v1/embeddings":
            return await self._embeddings(scoring)
        _, model = self._generation()
        settings = merged_settings(self.model_config, scoring.settings)
        params = generation_params(settings, self.task, model.vocab_size, self.saved_keys)
        try:
            async with asyncio.TaskGroup() as rows:
                answers = [
                    rows.create_task(self._generate(i, params, tenant, client))
                    for i in scoring.inputs
                ]
        except BaseExceptionGroup as failed:  # the other rows were cancelled
            raise failed.exceptions[0] from None
        return [answer.result() for answer in answers]

    async def _generate(
        self, value: Any, params: Any, tenant: str, client: Client
    ) -> dict[str, Any]:
        service, model = self._generation()
        kind = "chat" if self.task == "llm/v1/chat" else "text"
        body = {"messages": value} if kind == "chat" else {"prompt": value}
        try:
            prompt = await read_prompt(body, kind, model)
        except OpenAIError as exc:
            raise MlflowError(exc.message, "INVALID_PARAMETER_VALUE", exc.status) from exc
        if input_blocked(model, prompt):
            raise MlflowError(INPUT_FILTERED)
        answer = Completion(kind, model.name, len(prompt.ids), model.content_filter)
        request = GenerationRequest(
            service.new_request_id(), prompt.ids, params, tenant=tenant, client=client.key
        )
        constrained = params.constraint is not None
        events = client.metered(service.generate(request), params.max_new_tokens, constrained)
        await collect(events, answer)
        return answer.body()

    def _generation(self) -> tuple[InferenceService, ModelInfo]:
        """The service and model of a generative task (an embeddings-only server has neither)."""
        if self.service is None or self.model is None:
            raise MlflowError(f"{self.task} does not generate text", "INTERNAL_ERROR", 500)
        return self.service, self.model

    async def _embeddings(self, scoring: Scoring) -> dict[str, Any]:
        unknown = sorted(set(scoring.settings) - {"encoding_format"})
        if unknown or scoring.settings.get("encoding_format", "float") != "float":
            name = unknown[0] if unknown else "encoding_format"
            raise MlflowError(
                f"unsupported parameter {name!r} for llm/v1/embeddings", "INVALID_PARAMETER_VALUE"
            )
        data, usage = await embedded(self.embed, self.service, embedding_texts(scoring.inputs))
        return {"object": "list", "data": data, "usage": usage}


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type != "application/json":
        raise MlflowError(
            "This predictor only supports the following content types: "
            f"['application/json']. Got '{content_type}'.",
            status=415,
        )


class MlflowRoutes:
    """The scoring server's handlers over one scorer."""

    def __init__(
        self, scorer: MlflowScorer, mlflow: MlflowModel | None, body_limit_mb: int
    ) -> None:
        self.scorer, self.body_limit_mb = scorer, body_limit_mb
        self.server_version = mlflow.mlflow_version if mlflow and mlflow.mlflow_version else None

    async def invocations(self, request: Request) -> Response:
        try:
            _check_content_type(request)
            scoring = parse_scoring(await read_json(request, self.body_limit_mb), self.scorer.task)
            prediction = await self.scorer.predict(scoring, tenant_of(request), client_of(request))
        except APIError as exc:
            return error_response(exc)
        except ServiceError as exc:
            return service_error_response(exc)
        return JSONResponse(prediction if scoring.bare else {"predictions": prediction})

    async def ping(self) -> Response:
        return PlainTextResponse("\n")

    async def version(self) -> Response:
        return PlainTextResponse(self.server_version or metadata.version("pdserve"))


def create_mlflow_router(
    scorer: MlflowScorer, mlflow: MlflowModel | None, body_limit_mb: int
) -> APIRouter:
    routes = MlflowRoutes(scorer, mlflow, body_limit_mb)
    return create_router(
        ("POST", "/invocations", routes.invocations),
        *(("GET", path, routes.ping) for path in ("/ping", "/health")),
        ("GET", "/version", routes.version),
    )
