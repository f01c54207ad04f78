"""Coordinator configurations with overrides: what the management, tenant and security tests
share."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import trustme
import uvicorn
from fastapi import FastAPI

from coordinator.config.loader import defaults

KEY = "manage-secret"


def config_with(**http: Any) -> Any:
    overrides = {f"http_config.{k}": v for k, v in http.items()}
    overrides["backend_config.embedding_model_path"] = ""
    return defaults().with_overrides(overrides)


def get(app: FastAPI, path: str, **headers: str) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://manage") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(run())


@contextlib.contextmanager
def https_server(options: dict[str, Any]) -> Iterator[int]:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", **options
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def client_context(ca: trustme.CA, with_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    if with_cert:
        ca.issue_cert("client@pdserve").configure_cert(context)
    return context
