"""A real coordinator's four listeners (its ``uvicorn_configs``: predict, manage, status,
metrics) served in this process on free ports, with no cluster behind them (no Ray)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from coordinator.server import Coordinator
from tests.support.coordinator_configs import defaults

HEADER_CAP = 8192
DEADLINE_S = 1
# (listener, a GET it answers, a POST it answers before reading the body)
LISTENERS = {
    "predict": ("/v1/models", "/no-such-route"),
    "manage": ("/v1/instances", "/v1/instances"),
    "status": ("/v1/health", "/v1/health"),
    "external": ("/metrics", "/metrics"),
}


@contextlib.contextmanager
def coordinator_listeners(
    overrides: dict[str, Any] | None = None,
    prepare: Callable[[Coordinator], None] | None = None,
    **request_limit: int,
) -> Iterator[dict[str, str]]:
    """The listeners' urls by name; ``overrides`` (``{"section.key": value}``) on the test
    config, ``prepare`` called on the coordinator before it serves."""
    limits = {"max_header_bytes": HEADER_CAP, "header_timeout": DEADLINE_S}
    limits |= {"body_timeout": DEADLINE_S, **request_limit}
    config_overrides: dict[str, Any] = {f"request_limit.{key}": v for key, v in limits.items()}
    config_overrides |= {"backend_config.embedding_model_path": "", **(overrides or {})}
    coordinator = Coordinator(defaults().with_overrides(config_overrides))
    coordinator.ready = True
    if prepare is not None:
        prepare(coordinator)
    servers = []
    for listener_config in coordinator.uvicorn_configs():
        listener_config.port = 0
        servers.append(uvicorn.Server(listener_config))
    threads = [threading.Thread(target=s.run, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while not all(s.started for s in servers):
        assert time.monotonic() < deadline, "the listeners did not start"
        time.sleep(0.01)
    ports = [s.servers[0].sockets[0].getsockname()[1] for s in servers]
    try:
        yield {
            name: f"http://127.0.0.1:{port}" for name, port in zip(LISTENERS, ports, strict=True)
        }
    finally:
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(10)
