"""One request on the coordinator, from admission to its end: a :class:`RequestRun`, the single
source of truth that the service (``coordinator.inference``) and the cluster
(``coordinator.cluster``) share. No other table on the coordinator names a request; the service's
registry of live runs (by id, for an abort by id) is the one index, and a run leaves it however
it ends.

Life cycle, in :class:`RunPhase` order::

    QUEUED ─► ROUTED ─► PREFILLING ─┬─► HANDING_OFF ─┬─► DECODING ─► FINISHED
      ▲                             └────────────────┘ one worker does it all: no hand-off
      └─ migrate: the attempt failed (from any live phase)
    PREFILLING ─► FINISHED: the first token was the last
    any live phase ─► FAILED | ABORTED

- ``QUEUED``: admitted, waiting for a pair: a new request, or one migrating off a failed pair.
- ``ROUTED``: ``route_to`` set its pair (``route``) and made the attempt (``attempt``: the
  request itself, or after ``n`` migrations the request continued after ``output_token_ids``
  under the id ``<request id>-m<n>``). In ``pd_separate`` the decode worker reserves blocks now.
- ``PREFILLING``: a worker computes the prompt and the tokens so far: the prefill worker, the
  decode worker itself (the route's prefill side is None) or the colocated worker.
- ``HANDING_OFF``: ``pd_separate``: the first token is out; the KV pages move to the decode
  worker. A request that ends on its first token never gets here.
- ``DECODING``: the decode (or colocated) worker streams the next tokens.
- ``FINISHED``, ``FAILED``, ``ABORTED``: the end; ``outcome`` says which and why (``ok``, else the
  ``request_failed_total`` reason).

Invariants: within an attempt the phase only moves forward (``advance``); only ``migrate`` moves
it back, to ``QUEUED``, recording the failed route and its cause. A run has ended iff
``phase >= FINISHED``, and an ended run changes no more. ``output_token_ids`` are the output
tokens the service relayed to the client, in order, across attempts (``record``, as each event
goes out; ``first_token_at`` with the first): what the next attempt continues after.
``workers`` are the actors that may still hold the current attempt (what an abort reaches);
the cluster empties it when the attempt's stream ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from coordinator.routing.choice import Route
from coordinator.routing.pull_cost import PullPlan
from engine.outputs import TokenEvent
from engine.request import FinishReason
from workers.contracts import GenerationRequest


class RunPhase(IntEnum):
    """Where a run is (module docstring); the order is the life cycle's, the ended ones last."""

    QUEUED = 0
    ROUTED = 1
    PREFILLING = 2
    HANDING_OFF = 3
    DECODING = 4
    FINISHED = 5
    FAILED = 6
    ABORTED = 7


class Outcome(StrEnum):
    """How a run ended: ``ok``, or the ``request_failed_total`` reason."""

    OK = "ok"
    ABORTED = "aborted"  # the caller aborted it or went away
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"  # no pair could take it, or the coordinator is shutting down
    ERROR = "error"  # failed after its migrations were used up
    TOO_MANY_REQUESTS = "too_many_requests"


_ENDED_AS = {Outcome.OK: RunPhase.FINISHED, Outcome.ABORTED: RunPhase.ABORTED}


@dataclass(frozen=True)
class Migration:
    """An attempt that failed: on which pair, and why (the failure's ``cause``); ``spent``:
    counted against ``max_retry`` (not so an attempt that found its worker restarting)."""

    route: Route
    cause: str
    spent: bool = True


@dataclass(eq=False)
class RequestRun:
    """One request's state on the coordinator (module docstring). Equal only to itself."""

    request: GenerationRequest
    phase: RunPhase = RunPhase.QUEUED
    route: Route | None = None  # the current attempt's (prefill, decode) or (0, colocated)
    pull: PullPlan | None = None  # the current attempt's peer prefix pull, if one pays
    attempt: GenerationRequest = field(init=False)  # what the workers get (the last attempt's)
    workers: list[Any] = field(default_factory=list)  # actors that may hold the attempt
    migrations: list[Migration] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # relayed to the client so far
    created_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    aborted: bool = False  # its caller asked to abort it
    # refused for want of room: when the decode worker expected room for it (0: no estimate)
    retry_after_s: float = 0.0
    outcome: Outcome | None = None

    def __post_init__(self) -> None:
        self.attempt = self.request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def attempt_id(self) -> str:
        """The id the workers know the current attempt by."""
        return self.attempt.request_id

    @property
    def is_finished(self) -> bool:
        return self.phase >= RunPhase.FINISHED

    @property
    def num_migrations(self) -> int:
        return len(self.migrations)

    @property
    def num_spent(self) -> int:
        """Migrations counted against ``max_retry``."""
        return sum(migration.spent for migration in self.migrations)

    @property
    def failed_route(self) -> Route | None:
        """The pair the last failed attempt ran on (None: no attempt failed)."""
        return self.migrations[-1].route if self.migrations else None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and outputs so far: what the next attempt computes."""
        request = self.request
        return [*request.prompt_token_ids, *request.output_token_ids, *self.output_token_ids]

    def route_to(self, route: Route) -> None:
        """Start an attempt on ``route`` (``ROUTED``)."""
        self.route, self.phase, self.attempt = route, RunPhase.ROUTED, self.request
        if self.migrations:
            attempt_id = f"{self.request_id}-m{self.num_migrations}"
            self.attempt = self.request.continued(attempt_id, self.output_token_ids)

    def advance(self, phase: RunPhase) -> None:
        """Move forward to ``phase`` (a live one); an earlier or equal one changes nothing."""
        if not self.is_finished and self.phase < phase < RunPhase.FINISHED:
            self.phase = phase

    def record(self, event: TokenEvent) -> None:
        """An event on its way to the client: its token, if it has one, is the next output."""
        if event.token_id is None or event.finish_reason == FinishReason.ERROR:
            return
        self.output_token_ids.append(event.token_id)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def migrate(self, cause: str, spent: bool = True) -> None:
        """The current attempt failed with ``cause``: back to ``QUEUED`` for another pair."""
        assert self.route is not None, "only a routed run migrates"
        self.migrations.append(Migration(self.route, cause, spent))
        self.route, self.phase = None, RunPhase.QUEUED

    def abort(self) -> None:
        """Ask for its end (the cluster turns its stream's end into an abort); ended: nothing."""
        if not self.is_finished:
            self.aborted = True

    def end(self, outcome: Outcome) -> None:
        """Its end (``FINISHED``, ``ABORTED`` or ``FAILED`` by ``outcome``); the first one holds."""
        if not self.is_finished:
            self.outcome, self.phase = outcome, _ENDED_AS.get(outcome, RunPhase.FAILED)
