"""pdserve as a Ray Serve application: the coordinator's predict app as the Serve ingress.

    serve run coordinator.serve_app:build config=/path/ms_coordinator.json [model=...] \\
        [deploy_mode=...] [prefill=N] [decode=M] [kv_transport=...] \\
        [replicas=N cluster_name=NAME]

or a Serve config file whose application has ``import_path: coordinator.serve_app:build`` and
these ``args``. The ingress replica (no CPUs of its own) starts the prefill/decode actors on the
same Ray cluster once, when Serve builds its ASGI app, and stops them when the replica stops.
With ``replicas=N`` (N > 1) the ingress runs N replicas, each a coordinator in front of one
shared pool of workers, ``cluster_name`` (needed then): the first replica starts the pool, the
others find it, and a replica that stops leaves it running (docs/replicas.md).
Serve's HTTP proxy carries every predict route (``/infer``, ``/v1/*``, Azure, TGI, MLflow);
the probes are added to the same app, since Serve exposes a single port.

``/metrics`` would be public there too, so it is left out unless ``metrics=on``; then it is
behind the predict port's ``http_config.api_keys`` when they are set (Prometheus sends one as
its bearer token). HTTPS is the Serve proxy's (``http_options.ssl_certfile`` / ``ssl_keyfile``
of the Serve config) or an ingress's in front of it: a config with
``tls_config.request_server_tls_enable`` is refused, since the app cannot apply it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from ray import serve

from coordinator.api.app import missing_api_key
from coordinator.cli import OVERRIDES
from coordinator.config.loader import CoordinatorConfig, load_config
from engine.errors import ConfigError

if TYPE_CHECKING:
    from coordinator.server import Coordinator

log = logging.getLogger(__name__)
METRICS = ("off", "on")  # the ``metrics`` argument: /metrics left out, or behind the API keys
ARGS = {"config", "metrics", "replicas", *OVERRIDES}
MAX_REPLICAS = 64


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress()
class CoordinatorIngress:
    def __init__(self, args: dict[str, Any]) -> None:
        from coordinator.server import Coordinator

        config = serve_config(args)
        self.metrics = args.get("metrics", "off") == "on"
        self.coordinator = Coordinator(config)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return ingress_app(self.coordinator, metrics=self.metrics)


def ingress_app(coordinator: Coordinator, metrics: bool) -> FastAPI:
    """The probes, ``/metrics`` only with ``metrics`` (behind the API keys when set), and the
    predict app; its lifespan starts and stops the cluster."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await coordinator.start()
        yield
        await coordinator.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(coordinator.status_app().router)
    if metrics:
        keys = set(coordinator.config["http_config"]["api_keys"])

        @app.get("/metrics")
        async def gated_metrics(request: Request) -> Response:
            refused = missing_api_key(request, keys)
            return refused if refused is not None else await coordinator.exposition()

    app.mount("/", coordinator.predict_app())
    return app


def serve_config(args: dict[str, Any]) -> CoordinatorConfig:
    """The coordinator's config from the ``serve run`` arguments, read where the replica runs
    (its files and environment); a ConfigError for what Serve mode cannot honour: HTTPS of the
    app itself."""
    check_metrics_arg(args)
    overrides = {key: _value(args.get(option)) for option, key in OVERRIDES.items()}
    config = load_config(args.get("config")).with_overrides(overrides)
    if config["tls_config"]["request_server_tls_enable"]:
        raise ConfigError(
            "tls_config.request_server_tls_enable is not applied under Ray Serve: its HTTP proxy "
            "terminates the connections. Turn it off and give the certificate to the proxy "
            "(Serve config http_options: ssl_certfile, ssl_keyfile) or to an ingress in front "
            "of it"
        )
    return config


def check_metrics_arg(args: dict[str, Any]) -> None:
    metrics = args.get("metrics", "off")
    if metrics not in METRICS:
        raise ConfigError(f"metrics must be one of {list(METRICS)}, got {metrics!r}")


def _value(text: Any) -> Any:
    """``serve run`` passes ``key=value`` as strings: numbers and JSON objects are decoded."""
    if isinstance(text, str) and (text.isdigit() or text.startswith("{")):
        return json.loads(text)
    return text


def build(args: dict[str, str]) -> serve.Application:
    """The Serve application for ``serve run coordinator.serve_app:build key=value ...``."""
    unknown = sorted(set(args) - ARGS)
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; accepted: {sorted(ARGS)}")
    check_metrics_arg(args)
    replicas = check_replicas_arg(args)
    # serve.deployment replaces the class with a Deployment, which mypy cannot see
    ingress = CoordinatorIngress.options(num_replicas=replicas)  # type: ignore[attr-defined]
    return ingress.bind(dict(args))


def check_replicas_arg(args: dict[str, Any]) -> int:
    """The ``replicas`` argument (default 1); more than one needs a shared pool, so a
    ``cluster_name`` (as an argument or in the config file)."""
    text = str(args.get("replicas", "1"))
    if not text.isdigit() or not 1 <= int(text) <= MAX_REPLICAS:
        raise ConfigError(f"replicas must be an integer in [1, {MAX_REPLICAS}], got {text!r}")
    replicas = int(text)
    if replicas > 1 and not (
        args.get("cluster_name") or serve_config(args)["backend_config"]["cluster_name"]
    ):
        raise ConfigError(
            f"replicas={replicas} needs cluster_name (the worker pool every replica serves "
            "from), as an argument or backend_config.cluster_name; got none"
        )
    return replicas
