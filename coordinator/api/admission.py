"""Admission of requests that do not go through the generation service (embeddings): counted in
the same ``in_flight`` as generations, so ``request_limit.max_requests`` bounds them all and a
draining coordinator waits for them too.

Refused like a generation: 503 (:class:`~coordinator.errors.NoWorkerError`) while the coordinator
drains, 429 (:class:`~coordinator.errors.TooManyRequests`) when ``max_requests`` are in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from coordinator.errors import NoWorkerError, TooManyRequests


class Admission(Protocol):
    """What admission needs of the service: its counter, its limit and whether it drains."""

    in_flight: int
    max_requests: int
    draining: bool


@contextlib.asynccontextmanager
async def admitted(service: Admission | None) -> AsyncIterator[None]:
    """Count one request in flight while the block runs; raises when it cannot be admitted.
    ``None`` (no service: an embeddings-only test app) admits everything."""
    if service is None:
        yield
        return
    if service.draining:
        raise NoWorkerError("the coordinator is shutting down")
    if service.in_flight >= service.max_requests:
        raise TooManyRequests(
            f"{service.in_flight} requests in flight (max_requests {service.max_requests})"
        )
    service.in_flight += 1
    try:
        yield
    finally:
        service.in_flight -= 1
