"""The predict app: every front door's router, the API-key check, the not-ready answer, the
disconnect guard, and the answers to an unknown route or an unexpected failure (MindIE's error
body for both).

A request passes, in order: the not-ready gate (503), the API-key gate (401), the tenant gate
(:mod:`~coordinator.api.tenants`: the key's tenant, whose prefix cache is its own), the client
gate (:mod:`~coordinator.api.clients`: whose limits the request counts against), the door gate
(:mod:`~coordinator.api.admission`: 429 / 503 before the body is read), the disconnect guard
(:mod:`~coordinator.api.middleware`: a client that goes away cancels its handler, on every route),
then its door's handler.

Which doors open depends on what is served: a generating model opens MindIE, OpenAI (with its
Responses API), TGI, Azure chat and Anthropic's Messages; an embeddings-only server answers
``/v1/models`` and ``/info`` only; the embedding routes open when an embedding model is
configured, and MLflow's scoring routes always.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from functools import partial

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from coordinator.api import anthropic_format, azure, mindie, mlflow, openai, tgi
from coordinator.api.admission import DoorCount, DoorGate
from coordinator.api.anthropic import MESSAGES_PATHS, create_messages_router
from coordinator.api.azure import create_azure_router, create_info_router
from coordinator.api.body_budget import MIB, BodyBudget
from coordinator.api.clients import ClientLimits, Clients, record_client
from coordinator.api.common import internal_error_message, new_error_id
from coordinator.api.embeddings import Embed, EmbeddingRoutes, create_embeddings_router
from coordinator.api.errors import APIError
from coordinator.api.limits import default_body_limit_mb
from coordinator.api.middleware import DisconnectGuard, RequestGate
from coordinator.api.mindie import create_infer_router
from coordinator.api.mlflow import MlflowScorer, create_mlflow_router
from coordinator.api.openai import create_models_router, create_openai_router
from coordinator.api.responses import create_responses_router
from coordinator.api.responses_store import LocalResponses, ResponseKeeper, ResponseStore
from coordinator.api.tenants import Tenants, presented_keys, record_tenant
from coordinator.api.tgi import create_tgi_router
from coordinator.door_limits import DEFAULT_DOOR_LIMITS, DoorLimits
from coordinator.errors import RETRY_UNAVAILABLE_S, ServiceError
from coordinator.inference import InferenceService
from coordinator.served_model import ServedModels
from engine.config import SchedulerConfig

log = logging.getLogger(__name__)
GENERATION_DOORS = (
    create_infer_router,
    create_openai_router,
    create_tgi_router,
    create_azure_router,
    create_messages_router,
)


def create_predict_app(
    service: InferenceService,
    served: ServedModels,
    embed: Embed,
    *,
    body_limit_mb: int,
    api_keys: Iterable[str],
    is_ready: Callable[[], bool],
    max_input_tokens: int = SchedulerConfig.max_input_token_len,
    tenant_isolation: bool = True,
    door_limits: DoorLimits = DEFAULT_DOOR_LIMITS,
    shared_responses: SharedStore | None = None,
) -> FastAPI:
    """The app on the predict port; ``is_ready`` says whether the cluster is up;
    ``body_limit_mb`` 0: what the longest legal prompt needs (the served model's prompt limit,
    else ``max_input_tokens``); ``tenant_isolation``: each of ``api_keys`` a tenant with a
    prefix cache of its own; ``door_limits``: the budget of buffered bodies and each client's
    own limits; ``shared_responses``: the ``/v1/responses`` store of a pool this coordinator
    shares with others (none: its own)."""
    if not body_limit_mb:
        model = served.generation
        body_limit_mb = default_body_limit_mb(model.max_input_tokens if model else max_input_tokens)
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    store = response_store(door_limits, shared_responses)
    for router in create_routers(service, served, embed, body_limit_mb, store):
        app.include_router(router)
    # the middleware added last runs first: not ready → 503 before the key is even checked
    keys = set(api_keys)
    app.add_middleware(DisconnectGuard)
    app.state.door = DoorCount()
    app.state.body_budget = BodyBudget(door_limits.max_buffered_body_mb * MIB)
    app.add_middleware(
        DoorGate,
        service=service,
        count=app.state.door,
        refusal=door_refusal,
        budget=app.state.body_budget,
    )
    limits = ClientLimits(
        door_limits.max_requests_per_key,
        door_limits.tokens_per_minute_per_key,
        door_limits.grammar_compiles_per_minute_per_key,
        door_limits.max_constrained_requests_per_key,
    )
    if service is not None:
        limits.on_refusal = service.count_refusal
    clients = Clients(keys, limits, door_limits.priority_by_key)
    app.state.client_limits = limits
    app.add_middleware(RequestGate, refuse=partial(record_client, clients=clients))
    app.add_middleware(
        RequestGate, refuse=partial(record_tenant, tenants=Tenants(keys, tenant_isolation))
    )
    app.add_middleware(RequestGate, refuse=partial(missing_api_key, keys=keys))
    app.add_middleware(RequestGate, refuse=partial(not_ready, is_ready=is_ready))
    app.add_exception_handler(Exception, internal_error)
    app.add_exception_handler(404, partial(not_found, served=served))
    return app


SharedStore = Callable[[ResponseStore], ResponseKeeper]


def response_store(limits: DoorLimits, shared: SharedStore | None = None) -> ResponseKeeper | None:
    """The ``/v1/responses`` store the limits ask for (None: ``responses_store_mb`` 0): this
    coordinator's own, or with ``shared`` the one its pool shares, made with these bounds."""
    if not limits.responses_store_mb:
        return None
    total = limits.responses_store_mb * MIB
    store = ResponseStore(limits.responses_ttl_s, max_tenant_bytes=total // 4, max_bytes=total)
    return shared(store) if shared is not None else LocalResponses(store)


def create_routers(
    service: InferenceService,
    served: ServedModels,
    embed: Embed,
    body_limit_mb: int,
    store: ResponseKeeper | None = None,
) -> list[APIRouter]:
    model = served.generation
    if model is not None:
        routers = [create(service, model, body_limit_mb) for create in GENERATION_DOORS]
        routers.append(create_responses_router(service, model, body_limit_mb, store))
    else:
        routers = [create_models_router(served.name), create_info_router(served.name, "embeddings")]
    if served.embedding_path is not None:
        routes = EmbeddingRoutes(
            embed, served.embedding_name, served.embedding_dimensions, body_limit_mb, service
        )
        routers.append(create_embeddings_router(routes))
    config = served.mlflow.model_config if served.mlflow else {}
    scorer = MlflowScorer(served.task, config, service, model, embed)
    routers.append(create_mlflow_router(scorer, served.mlflow, body_limit_mb))
    return routers


OPENAI_PATHS = tuple(
    prefix + path
    for prefix in ("", openai.AZURE_V1)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
)
TGI_PATHS = ("/generate", "/generate_stream", "/")
AZURE_PATHS = tuple(
    prefix + path
    for prefix in azure.PREFIXES
    for path in ("/chat/completions", "/embeddings", "/images/embeddings")
)


def door_refusal(path: str, exc: ServiceError) -> Response:
    """A refusal at the door gate, in the error shape of the door ``path`` belongs to."""
    error = APIError.from_service(exc)
    if path in OPENAI_PATHS:
        return openai.service_error_response(error)
    if path in TGI_PATHS:
        return tgi.service_error_response(error)
    if path in AZURE_PATHS:
        return azure.error_response(error)
    if path in MESSAGES_PATHS:
        return anthropic_format.error_response(error)
    if path == "/invocations":
        return mlflow.service_error_response(exc)
    return mindie.service_error_response(error)


def require_api_keys(app: FastAPI, keys: Iterable[str]) -> None:
    """Gate every route of ``app`` behind ``keys`` (401 without one of them); none: open."""
    app.add_middleware(RequestGate, refuse=partial(missing_api_key, keys=set(keys)))


def authorized(request: Request, keys: set[str]) -> bool:
    """``api-key: K``, ``x-api-key: K`` or ``Authorization: Bearer K`` with one of ``keys``.
    Each presented key is
    compared with every configured one in constant time (no early exit, so the answer's timing
    tells nothing of how close a guess was); an empty key never matches (the configuration
    refuses one, :mod:`coordinator.config.loader`)."""
    presented = [k.encode("latin-1") for k in presented_keys(request) if k]
    wanted = [k.encode() for k in keys if k]
    matches = [hmac.compare_digest(p, k) for p in presented for k in wanted]
    return any(matches)


def missing_api_key(request: Request, keys: set[str]) -> Response | None:
    """With ``api_keys`` configured, 401 (Azure's error body) without a valid key."""
    if keys and not authorized(request, keys):
        message = "a valid api-key, x-api-key or Authorization: Bearer key is required"
        error = APIError(401, message, "Unauthorized")
        if request.url.path in MESSAGES_PATHS:
            return anthropic_format.error_response(error)
        return azure.error_response(error)
    return None


def not_ready(request: Request, is_ready: Callable[[], bool]) -> Response | None:
    """503 (MindIE's error body) while the cluster is starting."""
    if not is_ready():
        starting = "Service Unavailable: the cluster is starting"
        return mindie.error_response(APIError(503, starting, retry_after_s=RETRY_UNAVAILABLE_S))
    return None


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """500 with a generic message and a request id; the details are logged under that id only
    (never sent: they may hold tracebacks of the workers)."""
    error_id = new_error_id()
    log.error(
        "%s %s failed (request id %s)",
        request.method,
        request.url.path,
        error_id,
        exc_info=(type(exc), exc, exc.__traceback__),
    )
    response = mindie.error_response(APIError(500, internal_error_message(error_id)))
    response.headers["x-request-id"] = error_id
    return response


async def not_found(request: Request, exc: Exception, served: ServedModels) -> JSONResponse:
    message = f"no route {request.method} {request.url.path}"
    if served.generation is None:
        message += f": this server runs the embeddings model {served.name} only"
    return mindie.error_response(APIError(404, message))
