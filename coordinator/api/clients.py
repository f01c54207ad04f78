"""Each client's own limits, whoever else is served: a client is its API key (with
``http_config.api_keys``), else its address.

- **Requests open** (``request_limit.max_requests_per_key``, 0: no cap): counted by the door gate
  from the headers on, like ``max_requests`` (:mod:`~coordinator.api.admission`).
- **Generated tokens a minute** (``request_limit.tokens_per_minute_per_key``, 0: off): a token
  bucket per client (:mod:`~coordinator.api.token_bucket`), charged each generation's
  ``max_tokens`` when it starts and refunded what it did not generate when it ends.
- **Constrained requests open** (``request_limit.max_constrained_requests_per_key``, 0: no cap):
  generations with a structured-output constraint or forced tool calls (whose masks cost the
  workers' CPU every step), counted from their start to their end.
- **Grammars compiled a minute** (``request_limit.grammar_compiles_per_minute_per_key``, 0: off):
  a bucket per client of the structured-output specs (schemas, regexes, grammars) the door has
  not compiled (or refused) before; one the door has is free.
- **Priority** (``http_config.api_key_priority``, ``{key: best priority}``): a request's priority
  is an entitlement of its key. 1 is served first and 5 last; a request asking for a better
  (smaller) number than its key's is served at its key's. Once any key is listed, a key that is
  not (and a client without a key) is entitled to 5 only; with none listed, any priority is
  allowed.

Over a limit the request is answered 429 with ``Retry-After``, in its door's shape; the message
names the client's own limit, nothing of anyone else's traffic. Every such refusal is counted
where the door gate's are (``request_failed_total{reason="too_many_requests"}``): the requests
open by the door gate, the rest through ``ClientLimits.on_refusal``. The client gate records
each request's :class:`Client` (``request.state.client``) for the door gate and the doors.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from coordinator.api.tenants import presented_keys
from coordinator.api.token_bucket import TokenBuckets
from coordinator.errors import TooManyRequests
from engine.outputs import TokenEvent

BEST_PRIORITY, WORST_PRIORITY = 1, 5
Events = AsyncGenerator[TokenEvent, None]


class HeldPerKey(dict[str, int]):
    """How many of something each client key holds now, at most ``cap`` each (0: no cap)."""

    def __init__(self, cap: int, what: str) -> None:
        super().__init__()
        self.cap, self.what = cap, what

    def enter(self, key: str) -> None:
        """Count one more for ``key``, or raise :class:`TooManyRequests`."""
        held = self.get(key, 0)
        if self.cap and held >= self.cap:
            raise TooManyRequests(f"this key may have at most {self.cap} {self.what} at once")
        self[key] = held + 1

    def leave(self, key: str) -> None:
        held = self.pop(key) - 1
        if held:
            self[key] = held


@dataclass(eq=False)
class ClientLimits:
    """The limits every client has, and what each one holds of them now."""

    max_requests_per_key: int = 0
    tokens_per_minute_per_key: int = 0
    grammar_compiles_per_minute_per_key: int = 0
    max_constrained_requests_per_key: int = 0
    # counts a refusal of these limits (the service's request_failed_total; nothing by default)
    on_refusal: Callable[[], None] = field(default=lambda: None, repr=False)
    open: HeldPerKey = field(init=False)  # requests open, from the headers on
    constrained: HeldPerKey = field(init=False)  # constrained generations running
    tokens: TokenBuckets = field(init=False)
    compiles: TokenBuckets = field(init=False)

    def __post_init__(self) -> None:
        self.open = HeldPerKey(self.max_requests_per_key, "requests open")
        self.constrained = HeldPerKey(
            self.max_constrained_requests_per_key, "constrained requests open"
        )
        self.tokens = TokenBuckets(self.tokens_per_minute_per_key)
        self.compiles = TokenBuckets(
            self.grammar_compiles_per_minute_per_key,
            limit="compile at most {} new structured-output specs a minute",
        )


@dataclass(frozen=True)
class Client:
    """Who sent a request, as its limits and the engines' waiting queues know it: ``key`` a
    keyed hash of its API key, or of its address (never either itself: it travels to the
    workers); ``best_priority`` the best it may ask for."""

    key: str
    limits: ClientLimits
    best_priority: int = BEST_PRIORITY

    def priority(self, asked: int) -> int:
        """The priority the request is served at: what it asked, or its key's best."""
        return max(asked, self.best_priority)

    async def metered(self, events: Events, max_tokens: int, constrained: bool = False) -> Events:
        """``events``, with ``max_tokens`` taken from the client's token bucket before the first
        and (``constrained``) one of its constrained requests open counted, raising
        :class:`TooManyRequests` when either is not there; what was not generated given back,
        and the count taken back, at the end."""
        limits = self.limits
        try:
            if constrained:
                limits.constrained.enter(self.key)
            try:
                limits.tokens.take(self.key, max_tokens)
            except TooManyRequests:
                if constrained:
                    limits.constrained.leave(self.key)
                raise
        except TooManyRequests:
            limits.on_refusal()
            await events.aclose()
            raise
        generated = 0
        try:
            async for event in events:
                generated = event.num_output_tokens
                yield event
        finally:
            await events.aclose()
            limits.tokens.give_back(self.key, max_tokens - generated)
            if constrained:
                limits.constrained.leave(self.key)


UNLIMITED = Client("", ClientLimits())


class Clients:
    """The :class:`Client` of each request: its key's (``keys``), else its address's."""

    def __init__(
        self,
        keys: Iterable[str],
        limits: ClientLimits,
        priority_by_key: Mapping[str, int],
        secret: bytes | None = None,
    ) -> None:
        secret = secret or secrets.token_bytes(32)
        unlisted = WORST_PRIORITY if priority_by_key else BEST_PRIORITY
        self.limits, self._secret = limits, secret
        self._clients = {
            key: Client(
                "key:" + _keyed_hash(secret, key), limits, priority_by_key.get(key, unlisted)
            )
            for key in keys
            if key
        }
        self._anonymous_priority = unlisted

    def of(self, request: Request) -> Client:
        for key in presented_keys(request):
            client = self._clients.get(key)
            if client is not None:
                return client
        address = request.client.host if request.client else ""
        key = "address:" + _keyed_hash(self._secret, address)
        return Client(key, self.limits, self._anonymous_priority)


def _keyed_hash(secret: bytes, text: str) -> str:
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()[:32]


def record_client(request: Request, clients: Clients) -> Response | None:
    """The client gate (a ``RequestGate`` refusal that never refuses): records the request's
    :class:`Client` for the door gate and its door."""
    request.state.client = clients.of(request)
    return None


def client_of(request: Request) -> Client:
    """The client the gate recorded for ``request`` (unlimited when no gate ran)."""
    return getattr(request.state, "client", UNLIMITED)
