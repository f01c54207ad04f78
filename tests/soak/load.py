"""The soak test's load: ``concurrency`` senders, each sending one request after another from a
seeded mix until the run's time is up, so that never more than ``concurrency`` requests are in
flight. Every outcome is tallied by cause, by kind and by HTTP status."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.soak.client import CAUSES, Outcome, send_plan
from tests.soak.requests import LoadShape, Plan, draw_plan

MAX_EXAMPLES = 50  # unexpected outcomes kept in full


@dataclass
class Tally:
    started: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    by_cause: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(CAUSES, 0)))
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    by_status: Counter[str] = field(default_factory=Counter)
    unexpected: list[dict[str, Any]] = field(default_factory=list)

    def record(self, plan: Plan, outcome: Outcome) -> None:
        self.by_cause[outcome.cause] += 1
        self.by_kind.setdefault(plan.kind, Counter())[outcome.cause] += 1
        self.by_status[str(outcome.status) if outcome.status is not None else "none"] += 1
        if outcome.cause == "unexpected" and len(self.unexpected) < MAX_EXAMPLES:
            self.unexpected.append(
                {
                    "at_s": round(time.monotonic() - self.started, 2),
                    "kind": plan.kind,
                    "path": plan.path,
                    "status": outcome.status,
                    "detail": outcome.detail,
                }
            )

    def state(self) -> tuple[int, dict[str, int]]:
        return self.in_flight, dict(self.by_cause)

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": sum(self.by_cause.values()),
            "by_cause": dict(self.by_cause),
            "by_kind": {kind: dict(counts) for kind, counts in sorted(self.by_kind.items())},
            "by_status": dict(sorted(self.by_status.items())),
            "unexpected_examples": self.unexpected,
        }


@dataclass(frozen=True)
class LoadConfig:
    base_url: str
    duration_s: float
    concurrency: int
    mix: dict[str, float]
    shape: LoadShape
    seed: int
    request_timeout_s: float


async def run_load(client: httpx.AsyncClient, config: LoadConfig, tally: Tally) -> None:
    """Send the mix until ``duration_s`` has passed; returns when every request has ended."""
    deadline = time.monotonic() + config.duration_s
    await asyncio.gather(
        *(_sender(client, config, tally, deadline, index) for index in range(config.concurrency))
    )


async def _sender(
    client: httpx.AsyncClient, config: LoadConfig, tally: Tally, deadline: float, index: int
) -> None:
    rng = random.Random(config.seed * 1_000_003 + index)
    while time.monotonic() < deadline:
        plan = draw_plan(rng, config.mix, config.shape)
        tally.in_flight += 1
        try:
            outcome = await asyncio.wait_for(
                send_plan(client, config.base_url, plan), config.request_timeout_s
            )
        except TimeoutError:
            outcome = Outcome("unexpected", None, f"no end in {config.request_timeout_s} s")
        finally:
            tally.in_flight -= 1
        tally.record(plan, outcome)
