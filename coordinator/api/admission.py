"""Admission, twice: at the door, before any work, and in flight.

- **At the door** (:class:`DoorGate`, ASGI): every ``POST`` of the predict port is counted from
  its headers on, before its body is read, parsed or tokenized, until its answer is sent; with
  ``request_limit.max_requests`` of them open one more is refused at once. So the CPU that JSON
  and tokenizers cost is bounded by ``max_requests`` requests, and the memory of their bodies by
  the budget of buffered bodies (:mod:`~coordinator.api.body_budget`), taken as chunks arrive.
  Each client's own requests open are counted there too (:mod:`~coordinator.api.clients`).
- **In flight** (:func:`admitted`, and the generation service's own admission): generations and
  embeddings share ``in_flight``, so ``max_requests`` bounds them all (an ``/invocations`` request
  is one at the door and one in flight per row) and a draining coordinator waits for them too.

Both refuse alike: 503 (:class:`~coordinator.errors.NoWorkerError`) while the coordinator drains,
429 (:class:`~coordinator.errors.TooManyRequests`) at the limit; the door gate answers in the
shape of the door the path belongs to.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.api.body_budget import BodyBudget, BodyBudgetSpent, BudgetedBody, declared_length
from coordinator.api.clients import UNLIMITED
from coordinator.errors import ServiceError, TooManyRequests, check_room

DoorRefusal = Callable[[str, ServiceError], Response]  # (path, why) -> the door's answer


class Admission(Protocol):
    """What admission needs of the service (``InferenceService``): its counter, its limit,
    whether it drains, and where a refusal at the door is counted."""

    in_flight: int
    max_requests: int
    draining: bool

    def count_refusal(self) -> None:
        """One request refused before it reached the service: at the door, or by its client's
        limits (``request_failed_total``, like the service's own refusals)."""


@contextlib.asynccontextmanager
async def admitted(service: Admission | None) -> AsyncIterator[None]:
    """Count one request in flight while the block runs; raises when it cannot be admitted.
    ``None`` (no service: an embeddings-only test app) admits everything."""
    if service is None:
        yield
        return
    check_room(service.draining, service.in_flight, service.max_requests, "in flight")
    service.in_flight += 1
    try:
        yield
    finally:
        service.in_flight -= 1


@dataclass
class DoorCount:
    """The requests past the door gate and not yet answered."""

    open: int = 0


BODY_TOO_BIG_NOW = "the server is busy; retry later"


class DoorGate:
    """Counts each ``POST`` before its body is read; refuses it past ``max_requests`` open,
    while the service drains, or when its body does not fit in ``budget`` (see the module's
    docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        service: Admission | None,
        count: DoorCount,
        refusal: DoorRefusal,
        budget: BodyBudget,
    ) -> None:
        self.app, self.service, self.count, self.refusal = app, service, count, refusal
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or self.service is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("state", {}).get("client", UNLIMITED)
        try:
            check_room(self.service.draining, self.count.open, self.service.max_requests, "open")
            if not self.budget.fits(declared_length(scope["headers"])):
                raise TooManyRequests(BODY_TOO_BIG_NOW)
            client.limits.open.enter(client.key)
        except ServiceError as exc:
            await self.refuse(exc, scope, receive, send)
            return
        self.count.open += 1
        body = BudgetedBody(receive, self.budget)
        response = ResponseWatch(send)
        try:
            await self.app(scope, body.receive, response.send)
        except BodyBudgetSpent:
            if response.started:  # too late for a status: the connection ends unfinished
                raise
            await self.refuse(TooManyRequests(BODY_TOO_BIG_NOW), scope, receive, send)
        finally:
            body.release()
            self.count.open -= 1
            client.limits.open.leave(client.key)

    async def refuse(self, exc: ServiceError, scope: Scope, receive: Receive, send: Send) -> None:
        if self.service is not None:
            self.service.count_refusal()
        await self.refusal(scope["path"], exc)(scope, receive, send)


class ResponseWatch:
    """A request's ``send``, noting whether its answer has begun."""

    def __init__(self, send: Send) -> None:
        self.server_send, self.started = send, False

    async def send(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.server_send(message)
