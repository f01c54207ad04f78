"""Tenants: with ``http_config.api_keys`` set (and ``tenant_isolation`` on, the default), each
key is a tenant of its own, whose prompts share prefix-cache blocks with no other tenant's.

The predict app's tenant gate runs right after the API-key gate: it names the tenant of the key
the request presented and records it on the request (``request.state.tenant``, in the ASGI
scope's ``state``), and each door passes it on in its :class:`~workers.contracts.GenerationRequest`.
The router roots its prefix index in it and every worker its prefix-cache hashes (the decode
worker too, from its reservation, never from the pages), so a tenant's request can only hit its
own cached blocks, and ``cached_tokens`` never tells one client what another sent.

A tenant id is never the key: it is an HMAC-SHA256 of the key under a secret this coordinator
draws at start, so neither the workers, nor the wire between them, nor a log learns a key, and
one id tells nothing of another's. Ids last as long as the coordinator (its workers' caches with
it). No keys, or isolation off: no tenant (""), and every request shares one cache as before.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import Response

TENANT_ID_BYTES = 16


class Tenants:
    """The tenant of each API key (none when isolation is off or there are no keys)."""

    def __init__(
        self, keys: Iterable[str], isolation: bool = True, secret: bytes | None = None
    ) -> None:
        secret = secret or secrets.token_bytes(32)
        self._ids = {key: _tenant_id(secret, key) for key in (keys if isolation else ()) if key}

    def __bool__(self) -> bool:
        return bool(self._ids)

    def of(self, request: Request) -> str:
        """The tenant of the key ``request`` presents (``api-key: K`` first, then
        ``x-api-key: K``, then ``Authorization: Bearer K``); "" for none of the keys."""
        for key in presented_keys(request):
            tenant = self._ids.get(key)
            if tenant is not None:
                return tenant
        return ""


def presented_keys(request: Request) -> tuple[str, str, str]:
    """The keys ``request`` presents: ``api-key: K``, ``x-api-key: K`` (Anthropic's header),
    then ``Authorization: Bearer K``."""
    bearer = request.headers.get("authorization", "")
    token = bearer[7:] if bearer.lower().startswith("bearer ") else ""
    headers = request.headers
    return headers.get("api-key", ""), headers.get("x-api-key", ""), token


def _tenant_id(secret: bytes, key: str) -> str:
    digest = hmac.new(secret, key.encode(), hashlib.sha256).digest()
    return digest[:TENANT_ID_BYTES].hex()


def record_tenant(request: Request, tenants: Tenants) -> Response | None:
    """The tenant gate (a ``RequestGate`` refusal that never refuses): records the request's
    tenant for its door."""
    if tenants:
        request.state.tenant = tenants.of(request)
    return None


def tenant_of(request: Request) -> str:
    """The tenant the gate recorded for ``request`` ("": none)."""
    return getattr(request.state, "tenant", "")
