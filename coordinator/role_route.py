"""``POST /v1/instances/{n}/role`` on the management API: switch elastic worker ``n``
(``elastic_roles``) to another role while it serves (``coordinator/pool/role_switch.py``).

Body: ``{"role": "prefill" | "decode", "wait_s": 0-60}`` (``wait_s``, default 30: how long the
answer waits for the switch to end; 0 answers as soon as it started). Answers 200 with the
worker's role, epoch and whether it is still switching; 400 for a body that is not that (the
field named, with its range and the value received), 404 for no such worker, 409 when the
worker refuses (a switch under way to the other role, or it serves that role already) or the
cluster has no elastic workers, 503 when the worker does not answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from coordinator.api.common import read_body
from coordinator.pool.role_switch import RoleSwitcher
from workers.contracts import RoleState
from workers.role_gate import ROLES

BODY_LIMIT = 1024
DEFAULT_WAIT_S, MAX_WAIT_S = 30.0, 60.0


def add_role_route(app: FastAPI, switcher: RoleSwitcher | None) -> None:
    @app.post("/v1/instances/{instance}/role")
    async def switch_role(instance: int, request: Request) -> JSONResponse:
        if switcher is None:
            return _error(409, "workers switch roles only with elastic_roles: true (pd_separate)")
        try:
            role, wait_s = _parse(await read_body(request, BODY_LIMIT, _too_large))
        except ValueError as exc:
            return _error(400, str(exc))
        try:
            refusal, state = await switcher.switch(instance, role, wait_s)
        except (IndexError, ValueError) as exc:
            return _error(404, f"no elastic worker {instance}: {exc}")
        except ray.exceptions.RayError as exc:
            return _error(503, f"elastic worker {instance} did not answer: {type(exc).__name__}")
        if refusal:
            return JSONResponse({"error": refusal, **_row(instance, state)}, status_code=409)
        return JSONResponse(_row(instance, state))


def _parse(raw: bytes) -> tuple[str, float]:
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - {"role", "wait_s"})
    if unknown:
        raise ValueError(f"unknown fields {unknown}: the body takes role and wait_s")
    role = body.get("role")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    wait_s = body.get("wait_s", DEFAULT_WAIT_S)
    number = isinstance(wait_s, int | float) and not isinstance(wait_s, bool)
    if not number or not math.isfinite(wait_s) or not 0 <= wait_s <= MAX_WAIT_S:
        raise ValueError(f"wait_s must be a number in [0, {MAX_WAIT_S:g}], got {wait_s!r}")
    return role, float(wait_s)


def _row(instance: int, state: RoleState) -> dict[str, Any]:
    return {
        "instance": instance,
        "serving": state.serving,
        "role_epoch": state.epoch,
        "switching": state.switching,
    }


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _too_large(size: str) -> HTTPException:
    return HTTPException(413, f"a role switch request is at most {BODY_LIMIT} bytes, got {size}")
