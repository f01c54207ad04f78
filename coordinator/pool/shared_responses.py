"""A shared pool's ``/v1/responses`` store: one named, detached actor (``responses``) in the
pool's namespace holds a :class:`~coordinator.api.responses_store.ResponseStore` that every
coordinator of the pool keeps its responses in, so that a client goes on from a response
(``previous_response_id``, ``GET /v1/responses/{id}``) through whichever coordinator its
request reaches. The first coordinator that stores a response starts it (Ray's
``get_if_exists``: one per name), with its own bounds; it asks for no CPU and is stopped with
the pool (``pdserve workers --stop``). A coordinator that cannot reach it answers its requests
all the same and logs that the response was not kept.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import ray

from coordinator.api.responses_store import ResponseStore, Stored
from coordinator.errors import StoreUnavailable
from coordinator.pool.shared import actor_options

log = logging.getLogger(__name__)
ACTOR_NAME = "responses"


class ResponseStoreActor:
    """The pool's store; its methods run one at a time, in the order they arrive."""

    def __init__(self, ttl_s: float, max_tenant_bytes: int, max_bytes: int) -> None:
        self.store = ResponseStore(ttl_s, max_tenant_bytes=max_tenant_bytes, max_bytes=max_bytes)

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict]) -> bool:
        return self.store.put(tenant, response, conversation)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        return self.store.get(tenant, response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        return self.store.delete(tenant, response_id)


class SharedResponses:
    """A coordinator's handle on its pool's store (found, or started, at its first use)."""

    def __init__(self, namespace: str, store: ResponseStore) -> None:
        self.namespace = namespace
        self.bounds = (store.ttl_s, store.max_tenant_bytes, store.max_bytes)
        self._actor: Any = None
        self._lock = threading.Lock()

    def actor(self) -> Any:
        with self._lock:
            if self._actor is None:
                self._actor = (
                    ray.remote(ResponseStoreActor)
                    .options(
                        num_cpus=0, max_restarts=-1, **actor_options(self.namespace, ACTOR_NAME)
                    )  # fmt: skip
                    .remote(*self.bounds)
                )
            return self._actor

    async def put(self, tenant: str, response: dict[str, Any], conversation: list[dict]) -> bool:
        try:
            actor = await asyncio.to_thread(self.actor)
            return bool(await actor.put.remote(tenant, response, conversation))
        except ray.exceptions.RayError as exc:
            log.warning("response %s not kept: the pool's store is unreachable: %s",
                        response.get("id"), exc)  # fmt: skip
            return False

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        try:
            actor = await asyncio.to_thread(self.actor)
            stored: Stored | None = await actor.get.remote(tenant, response_id)
        except ray.exceptions.RayError as exc:
            raise StoreUnavailable(f"the response store is unreachable: {exc}") from None
        return stored

    async def delete(self, tenant: str, response_id: str) -> bool:
        try:
            actor = await asyncio.to_thread(self.actor)
            return bool(await actor.delete.remote(tenant, response_id))
        except ray.exceptions.RayError as exc:
            raise StoreUnavailable(f"the response store is unreachable: {exc}") from None
