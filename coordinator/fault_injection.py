"""The management API's ``POST /v1/faults`` (``PDSERVE_FAULT_INJECTION=1``, chaos testing only):
the route is added with a loud warning at start, and its body is read bounded.

A body over :data:`FAULT_BODY_LIMIT` bytes (declared or read so far) is refused with 413 before
the rest is read; a body that is not JSON raises ``ValueError`` (the route answers 400).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request

from coordinator.api.common import read_body
from workers.faults import FAULT_INJECTION_ENV, fault_injection_enabled

log = logging.getLogger(__name__)
FAULT_BODY_LIMIT = 4096  # bytes: a fault request is a few short fields


def add_fault_route(app: FastAPI, inject: Callable[[Request], Awaitable[Any]]) -> None:
    """``POST /v1/faults`` on ``app`` when fault injection is on, with a warning that says so."""
    if not fault_injection_enabled():
        return
    log.warning(
        "%s=1: FAULT INJECTION IS ON. POST /v1/faults on the management port breaks workers on "
        "request, and every worker accepts injected faults. For chaos tests only: never in "
        "production.",
        FAULT_INJECTION_ENV,
    )
    app.add_api_route("/v1/faults", inject, methods=["POST"])


async def read_fault_body(request: Request) -> Any:
    """The JSON body of a fault request; 413 past :data:`FAULT_BODY_LIMIT` bytes."""
    return json.loads(await read_body(request, FAULT_BODY_LIMIT, _too_large))


def _too_large(_size: str) -> HTTPException:
    return HTTPException(413, f"a fault request is at most {FAULT_BODY_LIMIT} bytes")
