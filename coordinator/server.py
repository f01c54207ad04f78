"""The coordinator process: the worker cluster plus its HTTP listeners.

Listeners: predict (``/infer`` and friends; HTTPS with ``tls_config``, client certificates required
with ``ca_cert``), manage (instance list; ``POST /v1/faults`` too when
``PDSERVE_FAULT_INJECTION=1``: chaos testing, always behind a key, see
:mod:`coordinator.fault_injection`; behind ``manage_api_keys`` when they are set, and never off
loopback without them),
status (probes: 503 until every actor is up, then 200; served by a thread of their own, on its
own event loop, so nothing on the predict port's loop delays them), external (``/metrics``).
Every listener runs behind the edge's limits (:mod:`coordinator.http_edge`: header size, header
and body deadlines, connection caps, none on the status listener). The cluster starts in the
background so the probes answer from the first second. SIGTERM stops taking new requests, lets
in-flight ones finish (bounded by ``drain_timeout_s``), then shuts the actors down and stops a
Ray it started itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import ssl
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import ray
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import coordinator.api.app as api_assembly
from coordinator.api.app import create_predict_app
from coordinator.cluster import Cluster
from coordinator.config.loader import CoordinatorConfig, check_manage_listener
from coordinator.connection_caps import ConnectionCaps
from coordinator.door_limits import door_limits
from coordinator.fault_injection import add_fault_route, fault_route_keys, read_fault_body
from coordinator.http_edge import EdgeLimits, uvicorn_limits
from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.planner import PlannerSettings
from coordinator.planner.loop import PlannerLoop
from coordinator.planner.traffic import TrafficWindow
from coordinator.planner_metrics import PlannerMetrics
from coordinator.pool.pool_size import PoolSize
from coordinator.pool.prefix_pull import PullOutcome
from coordinator.pool.role_switch import RoleSwitcher
from coordinator.pool.shared_responses import SharedResponses
from coordinator.ray_connect import init_ray
from coordinator.role_route import add_role_route
from coordinator.router import Router
from coordinator.served_model import cluster_config, routing_config, served_models
from coordinator.threaded_server import ThreadedServer
from coordinator.uvicorn_server import SignalFreeServer
from engine.errors import ConfigError
from workers.faults import fault_injection_enabled

log = logging.getLogger(__name__)
CONNECTION_HEADROOM = 64  # predict connections beyond max_requests (a client between requests)
SIDE_CAPS = ConnectionCaps(max_connections=64)  # the manage and metrics listeners
PROBES = ("/v1/startup", "/v1/health", "/v1/readiness", "/v2/health/live", "/v2/health/ready")


class Coordinator:
    def __init__(self, config: CoordinatorConfig, drain_timeout_s: float = 30.0) -> None:
        manage_keys = config["http_config"]["manage_api_keys"]
        self.fault_keys = fault_route_keys(manage_keys) if fault_injection_enabled() else ()
        self.config = config
        self.drain_timeout_s = drain_timeout_s
        self.served = served_models(config)
        self.model = self.served.generation
        self.metrics = Metrics(self.served.name)
        self.cluster = Cluster(cluster_config(config, self.served))
        self.cluster.on_handoff = self.metrics.record_handoff
        self.cluster.on_prefilled = self.metrics.record_prefill
        self.fleet = self.cluster.fleet
        cluster = self.cluster.config
        routing = routing_config(config, cluster.engine)
        if cluster.kv.peer_pull and cluster.deploy_mode == "pd_separate":
            routing = dataclasses.replace(routing, peer_pull=True)
        self.router = Router(self.fleet, routing=routing)
        self.router.view.on_reports = self.cluster.share_places
        self.cluster.on_pull = self._on_pull
        self.service = InferenceService(
            self.cluster,
            self.router,
            config["request_limit"]["max_requests"],
            config["exception_config"]["max_retry"],
            Timeouts(**config.fed(Timeouts)),
            self.metrics,
        )
        elastic = cluster.deploy_mode == "pd_separate" and cluster.elastic_roles
        self.switcher = RoleSwitcher(self.router.view, self.metrics) if elastic else None
        self.planner = self._planner(config)
        self._planning: asyncio.Task | None = None
        self.ready = False
        self.started_ray = False
        self._servers: list[uvicorn.Server] = []
        self._probes: ThreadedServer | None = None

    def _planner(self, config: CoordinatorConfig) -> PlannerLoop | None:
        """The role planner's loop (``planner: advise`` or ``execute``), fed by the service's
        traffic."""
        settings = PlannerSettings(**config.fed(PlannerSettings))
        scaling = self.cluster.config.max_workers > 0
        if scaling and settings.mode != "execute":
            raise ConfigError("max_workers needs planner: execute (the planner grows the pool)")
        if settings.mode == "off":
            return None
        if self.cluster.config.deploy_mode != "pd_separate":
            mode = settings.mode
            raise ConfigError(f"planner: {mode} needs deploy_mode pd_separate (it plans roles)")
        if settings.mode == "execute" and self.switcher is None:
            raise ConfigError("planner: execute needs elastic_roles: true (it switches roles)")
        traffic = TrafficWindow()
        self.service.traffic = traffic
        metrics = PlannerMetrics(self.metrics.registry, self.metrics.model_name)
        split = (self.cluster.config.num_prefill, self.cluster.config.num_decode)
        view, switcher = self.router.view, self.switcher
        pool = PoolSize(self.fleet, view) if scaling else None
        return PlannerLoop(settings, view, self.fleet, traffic, split, metrics, switcher, pool)

    def _on_pull(self, outcome: PullOutcome) -> None:
        """A peer prefix pull: its time teaches the router's cost model, and is a metric."""
        self.router.pull_costs.record(outcome.seconds, outcome.num_blocks, outcome.num_asked)
        self.metrics.record_pull(outcome)

    # ---- apps ------------------------------------------------------------------------------

    def predict_app(self) -> FastAPI:
        return create_predict_app(
            self.service,
            self.served,
            self.fleet.embed,
            body_limit_mb=self.config["request_limit"]["body_limit"],
            max_input_tokens=self.config["backend_config"]["maxInputTokenLen"],
            api_keys=self.config["http_config"]["api_keys"],
            tenant_isolation=self.config["http_config"]["tenant_isolation"],
            is_ready=lambda: self.ready,
            door_limits=door_limits(self.config),
            shared_responses=self._shared_responses(),
        )

    def _shared_responses(self) -> Callable[..., SharedResponses] | None:
        """The pool's response store, for coordinators sharing a pool (``cluster_name``)."""
        namespace = self.cluster.config.namespace
        return None if namespace is None else partial(SharedResponses, namespace)

    def status_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)
        for path in PROBES:
            app.add_api_route(path, self._probe, methods=["GET"])
        return app

    async def _probe(self) -> Response:
        return Response(status_code=200 if self.ready else 503)

    def external_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None)
        app.add_api_route("/metrics", self.exposition, methods=["GET"], name="metrics")
        return app

    async def exposition(self) -> Response:
        router = self.router
        self.metrics.record_loads(router.view.latest_loads)
        self.metrics.record_replicas(
            self.fleet.coordinator_id,
            router.view.latest_reports,
            router.cache.num_events,
            router.cache.num_resyncs,
        )
        self.metrics.record_grammars(self.model.grammars if self.model else None)
        return Response(
            self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def manage_app(self) -> FastAPI:
        """The management API; with ``http_config.manage_api_keys`` every route needs one of them
        (``api-key: K`` or ``Authorization: Bearer K``), else 401."""
        app = FastAPI(docs_url=None, redoc_url=None)
        api_assembly.require_api_keys(app, self.config["http_config"]["manage_api_keys"])
        if fault_injection_enabled():
            add_fault_route(app, self._inject_fault, self.fault_keys)
        add_role_route(app, self.switcher)

        @app.get("/v1/instances")
        async def instances() -> JSONResponse:
            return JSONResponse(
                {
                    "ready": self.ready,
                    "deploy_mode": self.cluster.config.deploy_mode,
                    "instances": self._instances(),
                }
            )

        return app

    def _instances(self) -> list[dict[str, Any]]:
        """Every worker, answering or not: its last reported load and identity (none before its
        first answer), its ``status`` and the seconds since it last answered a poll."""
        now = time.monotonic()
        rows = []
        for worker, load in self.router.view.workers():
            row = {"role": worker.role, "instance": worker.instance}
            if load is not None:
                row = load.to_dict(self.fleet.identity(load))
            if worker.role_state is not None:  # as last heard: a switch answered since the poll
                state = worker.role_state
                row |= {"serving": state.serving, "role_epoch": state.epoch,
                        "switching": state.switching}  # fmt: skip
            row["status"] = "starting" if load is None and worker.fresh else worker.status(now)
            row["seconds_since_report"] = None if load is None else round(now - worker.last_seen, 3)
            rows.append(row)
        return rows

    async def _inject_fault(self, request: Request) -> JSONResponse:
        """``{"role": "decode", "instance": 0, "fault": "break_transport", "count": 1}``: the
        worker's ``inject_fault`` (``docs/kv-handoff.md``); 400 when it refuses."""
        try:
            body = await read_fault_body(request)
            worker = self.fleet.worker(str(body["role"]), int(body["instance"]))
            await worker.inject_fault.remote(str(body["fault"]), int(body.get("count", 1)))
        except (ValueError, KeyError, TypeError, IndexError, ray.exceptions.RayError) as exc:
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        return JSONResponse({"injected": body})

    # ---- lifecycle ---------------------------------------------------------------------------

    def start_cluster(self) -> None:
        """Blocking: Ray, the actors, the first load poll."""
        address = self.config["backend_config"]["ray_address"] or None
        self.started_ray = init_ray(address)
        start = time.monotonic()
        self.fleet.start()
        log.info(
            "cluster up in %.1f s: %s", time.monotonic() - start, self.cluster.config.deploy_mode
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.start_cluster)
        await self.router.view.refresh()
        self.router.view.start()
        if self.planner is not None:
            self._planning = asyncio.ensure_future(self.planner.run())
        self.ready = True
        log.info("ready: /v1/readiness answers 200")

    def uvicorn_configs(self) -> list[uvicorn.Config]:
        """The four listeners (predict, manage, status, external); a ConfigError when the manage
        listener would be unprotected."""
        check_manage_listener(self.config)
        http = self.config["http_config"]
        tls_args = tls_options(self.config["tls_config"])
        edge = EdgeLimits(**self.config.fed(EdgeLimits))
        limit = self.config["request_limit"]
        predict_caps = ConnectionCaps(
            limit["max_connections"] or limit["max_requests"] + CONNECTION_HEADROOM,
            limit["max_connections_per_client"],
        )
        common: dict[str, Any] = {
            "log_level": "warning",
            "lifespan": "off",
            "timeout_graceful_shutdown": 5,
        }
        listeners = [  # (app, address, port, TLS, connection caps)
            (self.predict_app(), http["predict_ip"], http["predict_port"], tls_args, predict_caps),
            (self.manage_app(), http["manage_ip"], http["manage_port"], {}, SIDE_CAPS),
            (self.status_app(), http["predict_ip"], http["status_port"], {}, ConnectionCaps()),
            (self.external_app(), http["predict_ip"], http["external_port"], {}, SIDE_CAPS),
        ]
        return [
            uvicorn.Config(app, host=host, port=port, **tls, **common, **uvicorn_limits(edge, caps))
            for app, host, port, tls, caps in listeners
        ]

    async def serve(self) -> int:
        """Serves until SIGTERM/SIGINT (then drains): 0; or until the cluster fails to start
        (logged): 1, the process's exit status."""
        self._servers = [SignalFreeServer(c) for c in self.uvicorn_configs()]
        self._probes = ThreadedServer(self._servers.pop(2), "probes")
        self._probes.start()
        loop = asyncio.get_running_loop()
        log.info("event loop: %s", type(loop).__module__.partition(".")[0])
        stop = asyncio.Event()

        def handle_signals() -> None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)

        handle_signals()
        serving = [asyncio.ensure_future(s.serve()) for s in self._servers]
        starting = asyncio.ensure_future(self.start())

        def started(task: asyncio.Future) -> None:
            # ray.init installs its own C++ SIGTERM handler (which ends the process without a
            # drain); take the signals back once it has run.
            handle_signals()
            failure = _failure(task)
            if failure is not None:  # never ready: stop rather than answer 503 forever
                log.error("the cluster did not start: %s", failure, exc_info=failure)
                stop.set()

        starting.add_done_callback(started)
        await stop.wait()
        await self.shutdown(starting)
        await asyncio.gather(*serving, return_exceptions=True)
        return 0 if _failure(starting) is None else 1

    async def shutdown(self, starting: asyncio.Future | None = None) -> None:
        log.info("draining %d in-flight requests", self.service.in_flight)
        self.service.draining = True
        deadline = time.monotonic() + self.drain_timeout_s
        while self.service.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for server in self._servers:
            server.should_exit = True
        if self._probes is not None:
            await self._probes.stop()
        if starting is not None and not starting.done():
            starting.cancel()
        if self._planning is not None:
            self._planning.cancel()
        await self.router.view.stop()
        await self.fleet.aclose()
        if ray.is_initialized():
            self.fleet.shutdown()
            if self.started_ray:
                ray.shutdown()


def _failure(task: asyncio.Future) -> BaseException | None:
    """What a finished task raised (None: still running, cancelled or succeeded)."""
    return task.exception() if task.done() and not task.cancelled() else None


def tls_options(tls: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's TLS settings for the predict port: none unless ``request_server_tls_enable``;
    with ``ca_cert`` (mutual TLS) a client must present a certificate that CA signed, else the
    handshake fails."""
    if not tls["request_server_tls_enable"]:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls["tls_cert"], "ssl_keyfile": tls["tls_key"]}
    if tls["ca_cert"]:
        options["ssl_ca_certs"] = tls["ca_cert"]
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options
