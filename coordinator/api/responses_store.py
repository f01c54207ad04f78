"""The responses ``/v1/responses`` keeps (``store: true``, the API's default), so that a later
request can go on from one (``previous_response_id``) and ``GET /v1/responses/{id}`` can read it.

Bounded, in this coordinator's memory (``request_limit.responses_store_mb`` and
``responses_ttl_s``; the defaults below): a response lives ``ttl_s`` seconds; each tenant (an
API key's, or everyone's without keys) keeps at most ``max_per_tenant`` responses and
``max_tenant_bytes`` bytes of them (the oldest go first), and every tenant together at most
``max_bytes`` (the oldest anywhere go first). A response is kept with the conversation that
led to it (its input items, then its output items), so a request naming it costs no lookups past
that one; a tenant never reads another's. ``store: false`` keeps nothing.

The routes reach a store through a :class:`ResponseKeeper`: this coordinator's own
(:class:`LocalResponses`), or, for coordinators sharing a pool of workers (``cluster_name``), the
pool's one store in a named actor (``coordinator/pool/shared_responses.py``), so that a client
goes on from a response through any of them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

TTL_S = 3600.0
MAX_PER_TENANT = 1024
MAX_TENANT_BYTES = 64 * 1024 * 1024
MAX_BYTES = 256 * 1024 * 1024


@dataclass
class Stored:
    response: dict[str, Any]  # the response object as answered
    conversation: list[dict[str, Any]]  # the input items and output items, in order
    tenant: str
    size: int
    expires: float


@dataclass
class ResponseStore:
    ttl_s: float = TTL_S
    max_per_tenant: int = MAX_PER_TENANT
    max_tenant_bytes: int = MAX_TENANT_BYTES
    max_bytes: int = MAX_BYTES
    _items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    num_bytes: int = 0

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict]) -> bool:
        """Keep ``response`` for ``tenant``; False when it alone is over a bound (not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > min(self.max_tenant_bytes, self.max_bytes):
            return False
        with self._lock:
            self._expire(time.monotonic())
            stored = Stored(response, conversation, tenant, size, time.monotonic() + self.ttl_s)
            self._items[response["id"]] = stored
            self.num_bytes += size
            self._trim(tenant)
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The response ``tenant`` stored under ``response_id`` (None: none, expired, or
        another tenant's)."""
        with self._lock:
            self._expire(time.monotonic())
            stored = self._items.get(response_id)
        return stored if stored is not None and stored.tenant == tenant else None

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is None or stored.tenant != tenant:
                return False
            self._drop(response_id)
        return True

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self, now: float) -> None:
        while self._items:
            oldest_id, oldest = next(iter(self._items.items()))
            if oldest.expires > now:
                return
            self._drop(oldest_id)

    def _trim(self, tenant: str) -> None:
        own = [(key, s) for key, s in self._items.items() if s.tenant == tenant]
        count, size = len(own), sum(s.size for _, s in own)
        for key, stored in own:
            if count <= self.max_per_tenant and size <= self.max_tenant_bytes:
                break
            self._drop(key)
            count, size = count - 1, size - stored.size
        while self.num_bytes > self.max_bytes and self._items:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        stored = self._items.pop(response_id)
        self.num_bytes -= stored.size


class ResponseKeeper(Protocol):
    """Where ``/v1/responses`` keeps its responses (:class:`ResponseStore`'s methods, awaited)."""

    async def put(
        self, tenant: str, response: dict[str, Any], conversation: list[dict]
    ) -> bool: ...

    async def get(self, tenant: str, response_id: str) -> Stored | None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...


class LocalResponses:
    """This coordinator's own store."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, tenant: str, response: dict[str, Any], conversation: list[dict]) -> bool:
        return self.store.put(tenant, response, conversation)

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        return self.store.get(tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self.store.delete(tenant, response_id)
