"""The management API's ``POST /v1/faults`` (``PDSERVE_FAULT_INJECTION=1``, chaos testing only):
the route is added with a loud warning at start, always needs a key, and reads its body bounded.

The key is one of ``http_config.manage_api_keys`` where they are set (like every management
route); without them, ``PDSERVE_FAULT_INJECTION_KEY``, and a coordinator with fault injection on
and neither refuses to start (:func:`fault_route_keys`): breaking workers on request is never
open to whoever reaches the port, loopback included. A request without the key (``api-key: K``
or ``Authorization: Bearer K``) is answered 401.

A body over :data:`FAULT_BODY_LIMIT` bytes (declared or read so far) is refused with 413 before
the rest is read; a body that is not JSON raises ``ValueError`` (the route answers 400).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response

from coordinator.api.app import missing_api_key
from coordinator.api.common import read_body
from engine.errors import ConfigError
from workers.faults import FAULT_INJECTION_ENV, fault_injection_enabled

log = logging.getLogger(__name__)
FAULT_BODY_LIMIT = 4096  # bytes: a fault request is a few short fields
FAULT_KEY_ENV = "PDSERVE_FAULT_INJECTION_KEY"


def fault_route_keys(
    manage_api_keys: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The keys that open ``POST /v1/faults``: ``manage_api_keys`` when there are any, else the
    one of ``PDSERVE_FAULT_INJECTION_KEY``; a ConfigError when there is neither."""
    if manage_api_keys:
        return tuple(manage_api_keys)
    key = (os.environ if environ is None else environ).get(FAULT_KEY_ENV, "")
    if not key.strip():
        raise ConfigError(
            f"{FAULT_INJECTION_ENV}=1 needs a key for POST /v1/faults: set "
            f"http_config.manage_api_keys, or {FAULT_KEY_ENV} to a non-blank key"
        )
    return (key,)


def add_fault_route(
    app: FastAPI, inject: Callable[[Request], Awaitable[Response]], keys: Sequence[str]
) -> None:
    """``POST /v1/faults`` on ``app`` when fault injection is on, with a warning that says so;
    a request without one of ``keys`` (:func:`fault_route_keys`) is answered 401."""
    if not fault_injection_enabled():
        return
    if not keys:
        raise ConfigError(f"POST /v1/faults needs a key ({FAULT_KEY_ENV})")
    wanted = set(keys)

    async def keyed_inject(request: Request) -> Response:
        refused = missing_api_key(request, wanted)
        return refused if refused is not None else await inject(request)

    log.warning(
        "%s=1: FAULT INJECTION IS ON. POST /v1/faults on the management port breaks workers on "
        "request, and every worker accepts injected faults. For chaos tests only: never in "
        "production.",
        FAULT_INJECTION_ENV,
    )
    app.add_api_route("/v1/faults", keyed_inject, methods=["POST"])


async def read_fault_body(request: Request) -> Any:
    """The JSON body of a fault request; 413 past :data:`FAULT_BODY_LIMIT` bytes."""
    return json.loads(await read_body(request, FAULT_BODY_LIMIT, _too_large))


def _too_large(_size: str) -> HTTPException:
    return HTTPException(413, f"a fault request is at most {FAULT_BODY_LIMIT} bytes")
