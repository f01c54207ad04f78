"""A peer prefix pull, driven by the coordinator before it sends a prompt to its prefill worker
(``kv_peer_pull``; the worker side: ``workers/prefix_pulls.py``): the prefill worker sets blocks
aside for the leading blocks the router's plan names (``coordinator/routing/pull_cost.py``), the
worker holding them sends them over the KV plane, and the prompt then finds them cached. Any
failure leaves the prompt to compute those blocks: a pull never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from coordinator.routing.pull_cost import PullPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullOutcome:
    """What one pull did: blocks asked for and installed, bytes moved, seconds, why it failed."""

    source_role: str
    num_asked: int
    num_blocks: int
    num_bytes: int
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.num_blocks > 0


async def pull_prefix(
    puller: Any, source: Any, plan: PullPlan, token_ids: list[int], tenant: str, timeout_s: float
) -> PullOutcome | None:
    """Pull ``plan``'s blocks of ``token_ids`` from actor ``source`` into actor ``puller``
    within ``timeout_s``; None when the puller needed none of them (or takes no pulls)."""
    start = time.monotonic()
    offer = None
    role = plan.source[0]
    try:
        offer = await asyncio.wait_for(
            puller.open_pull.remote(token_ids, tenant, plan.num_blocks), timeout_s
        )
        if offer is None:
            return None
        left = max(timeout_s - (time.monotonic() - start), 0.001)
        sent = await asyncio.wait_for(source.send_prefix.remote(token_ids, tenant, offer), left)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        sent = None
    seconds = time.monotonic() - start
    num_asked = offer.ticket.num_blocks if offer is not None else 0
    if sent is not None and sent.num_blocks:
        return PullOutcome(role, num_asked, sent.num_blocks, sent.num_bytes, seconds)
    if sent is not None:
        error = sent.error or "no block sent"
    if offer is not None:  # its blocks are freed now, not at its deadline
        puller.cancel_pull.remote(offer.ticket.pull_id)
    log.info("prefix pull from %s failed after %.3f s: %s", plan.source, seconds, error)
    return PullOutcome(role, num_asked, 0, 0, seconds, error)
