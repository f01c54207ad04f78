"""pdserve as a Ray Serve application: the coordinator's predict app as the Serve ingress.

    serve run coordinator.serve_app:build config=/path/ms_coordinator.json [model=...] \\
        [deploy_mode=...] [prefill=N] [decode=M] [kv_transport=...]

or a Serve config file whose application has ``import_path: coordinator.serve_app:build`` and
these ``args``. The ingress replica (no CPUs of its own) starts the prefill/decode actors on the
same Ray cluster once, when Serve builds its ASGI app, and stops them when the replica stops.
Serve's HTTP proxy carries every predict route (``/infer``, ``/v1/*``, Azure, TGI, MLflow);
the probes and ``/metrics`` are added to the same app, since Serve exposes a single port.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve

from coordinator.cli import OVERRIDES
from coordinator.config import load_config

log = logging.getLogger(__name__)
ARGS = {"config", *OVERRIDES}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress()
class CoordinatorIngress:
    def __init__(self, args: dict[str, Any]) -> None:
        from coordinator.server import Coordinator

        overrides = {key: _value(args.get(option)) for option, key in OVERRIDES.items()}
        config = load_config(args.get("config")).with_overrides(overrides)
        self.coordinator = Coordinator(config)

    def __serve_build_asgi_app__(self) -> FastAPI:
        coordinator = self.coordinator

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await coordinator.start()
            yield
            await coordinator.shutdown()

        app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.include_router(coordinator.status_app().router)
        app.include_router(coordinator.external_app().router)
        app.mount("/", coordinator.predict_app())
        return app


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
    # serve.deployment replaces the class with a Deployment, which mypy cannot see
    return CoordinatorIngress.bind(dict(args))  # type: ignore[attr-defined]
