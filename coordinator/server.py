"""The coordinator process: the worker cluster plus its HTTP listeners.

Listeners: predict (``/infer`` and friends; HTTPS with ``tls_config``), manage (instance list),
status (probes: 503 until every actor is up, then 200), external (``/metrics``). The cluster
starts in the background so the probes answer from the first second. SIGTERM stops taking new
requests, lets in-flight ones finish (bounded by ``drain_timeout_s``), then shuts the actors
down and stops a Ray it started itself.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import ray
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from coordinator.azure_api import create_azure_router, create_info_router
from coordinator.cluster import Cluster, init_ray
from coordinator.config import CoordinatorConfig
from coordinator.embeddings_api import create_embeddings_router
from coordinator.infer_api import APIError, create_infer_router
from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.mlflow_api import MlflowScorer, create_mlflow_router
from coordinator.openai_api import create_models_router, create_openai_router
from coordinator.router import Router
from coordinator.served_model import cluster_config, served_models
from coordinator.tgi_api import create_tgi_router

log = logging.getLogger(__name__)
PROBES = ("/v1/startup", "/v1/health", "/v1/readiness", "/v2/health/live", "/v2/health/ready")


class Coordinator:
    def __init__(self, config: CoordinatorConfig, drain_timeout_s: float = 30.0) -> None:
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.served = served_models(config)
        self.model = self.served.generation
        self.metrics = Metrics(self.served.name)
        self.cluster = Cluster(cluster_config(config, self.served))
        self.cluster.on_handoff = self.metrics.record_handoff
        self.router = Router(self.cluster)
        exc = config["exception_config"]
        self.service = InferenceService(
            self.cluster,
            self.router,
            config["request_limit"]["max_requests"],
            exc["max_retry"],
            Timeouts(exc["schedule_timeout"], exc["first_token_timeout"], exc["infer_timeout"]),
            self.metrics,
        )
        self.ready = False
        self.started_ray = False
        self._servers: list[uvicorn.Server] = []

    # ---- apps ------------------------------------------------------------------------------

    def predict_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
        limit = self.config["request_limit"]["body_limit"]
        served = self.served
        if self.model is not None:
            app.include_router(create_infer_router(self.service, self.model, limit))
            app.include_router(create_openai_router(self.service, self.model, limit))
            app.include_router(create_tgi_router(self.service, self.model, limit))
            app.include_router(create_azure_router(self.service, self.model, limit))
        else:
            app.include_router(create_models_router(served.name))
            app.include_router(create_info_router(served.name, "embeddings"))
        if served.embedding_path is not None:
            app.include_router(
                create_embeddings_router(
                    self.cluster, served.embedding_name, served.embedding_dimensions, limit
                )
            )
        config = served.mlflow.model_config if served.mlflow else {}
        scorer = MlflowScorer(served.task, config, self.service, self.model, self.cluster.embed)
        app.include_router(create_mlflow_router(scorer, served.mlflow, limit))
        keys = set(self.config["http_config"]["api_keys"])

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if keys and not _authorized(request, keys):
                return JSONResponse(
                    {
                        "error": {
                            "code": "Unauthorized",
                            "message": "a valid api-key or Authorization: Bearer key is required",
                        }
                    },
                    status_code=401,
                )
            return await call_next(request)

        @app.middleware("http")
        async def not_ready(request: Request, call_next):
            if not self.ready:
                return APIError(
                    503, "Service Unavailable: the cluster is starting", "Service Unavailable"
                ).response()
            return await call_next(request)

        @app.exception_handler(Exception)
        async def internal(request: Request, exc: Exception) -> JSONResponse:
            log.exception("%s %s failed", request.method, request.url.path)
            return APIError(
                500, f"Incomplete Generation: {type(exc).__name__}: {exc}", "Incomplete Generation"
            ).response()

        @app.exception_handler(404)
        async def not_found(request: Request, exc: Exception) -> JSONResponse:
            message = f"no route {request.method} {request.url.path}"
            if self.model is None:
                message += f": this server runs the embeddings model {served.name} only"
            return APIError(404, message, "NotFoundError").response()

        return app

    def status_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)
        for path in PROBES:
            app.add_api_route(path, self._probe, methods=["GET"])
        return app

    async def _probe(self) -> Response:
        return Response(status_code=200 if self.ready else 503)

    def external_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.get("/metrics")
        async def metrics() -> Response:
            self.metrics.record_loads(self.router.latest_loads)
            return Response(
                self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
            )

        return app

    def manage_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)

        @app.get("/v1/instances")
        async def instances() -> JSONResponse:
            return JSONResponse(
                {
                    "ready": self.ready,
                    "deploy_mode": self.cluster.config.deploy_mode,
                    "instances": self.router.latest_loads,
                }
            )

        return app

    # ---- lifecycle ---------------------------------------------------------------------------

    def start_cluster(self) -> None:
        """Blocking: Ray, the actors, the first load poll."""
        address = self.config["backend_config"]["ray_address"] or None
        self.started_ray = init_ray(address)
        start = time.monotonic()
        self.cluster.start()
        log.info(
            "cluster up in %.1f s: %s", time.monotonic() - start, self.cluster.config.deploy_mode
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.start_cluster)
        await self.router.refresh()
        self.router.start()
        self.ready = True
        log.info("ready: /v1/readiness answers 200")

    def uvicorn_configs(self) -> list[uvicorn.Config]:
        http, tls = self.config["http_config"], self.config["tls_config"]
        tls_args: dict[str, Any] = {}
        if tls["request_server_tls_enable"]:
            tls_args = {"ssl_certfile": tls["tls_cert"], "ssl_keyfile": tls["tls_key"]}
            if tls["ca_cert"]:
                tls_args["ssl_ca_certs"] = tls["ca_cert"]
        common = {"log_level": "warning", "lifespan": "off", "timeout_graceful_shutdown": 5}
        return [
            uvicorn.Config(
                self.predict_app(),
                host=http["predict_ip"],
                port=http["predict_port"],
                **tls_args,
                **common,
            ),
            uvicorn.Config(
                self.manage_app(), host=http["manage_ip"], port=http["manage_port"], **common
            ),
            uvicorn.Config(
                self.status_app(), host=http["predict_ip"], port=http["status_port"], **common
            ),
            uvicorn.Config(
                self.external_app(), host=http["predict_ip"], port=http["external_port"], **common
            ),
        ]

    async def serve(self) -> None:
        self._servers = [uvicorn.Server(c) for c in self.uvicorn_configs()]
        for server in self._servers:
            server.install_signal_handlers = lambda: None  # we drain first, then stop them
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def handle_signals() -> None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)

        handle_signals()
        serving = [asyncio.ensure_future(s.serve()) for s in self._servers]
        starting = asyncio.ensure_future(self.start())
        # ray.init installs its own C++ SIGTERM handler (which ends the process without a drain);
        # take the signals back once it has run.
        starting.add_done_callback(lambda _: handle_signals())
        await stop.wait()
        await self.shutdown(starting)
        await asyncio.gather(*serving, return_exceptions=True)

    async def shutdown(self, starting: asyncio.Future | None = None) -> None:
        log.info("draining %d in-flight requests", self.service.in_flight)
        self.service.draining = True
        deadline = time.monotonic() + self.drain_timeout_s
        while self.service.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for server in self._servers:
            server.should_exit = True
        if starting is not None and not starting.done():
            starting.cancel()
        await self.router.stop()
        if ray.is_initialized():
            self.cluster.shutdown()
            if self.started_ray:
                ray.shutdown()


def with_model(config: CoordinatorConfig, **backend: Any) -> CoordinatorConfig:
    """Copy of ``config`` with ``backend_config`` keys replaced (tests, benchmarks)."""
    return config.with_overrides({f"backend_config.{k}": v for k, v in backend.items()})


def _authorized(request: Request, keys: set[str]) -> bool:
    bearer = request.headers.get("authorization", "")
    token = bearer[7:] if bearer.lower().startswith("bearer ") else None
    return request.headers.get("api-key") in keys or token in keys
