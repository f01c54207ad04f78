"""Load- and cache-aware choice of the (prefill, decode) pair for each request.

Worker loads are polled in the background (``routing/worker_view.py``, every
``load_poll_interval_ms``); between polls the router counts what it dispatched itself, so a burst
of requests spreads out instead of piling onto the worker that looked idle at the last poll.
Prefill load: prompt tokens queued. Decode load: running requests.

Engines keep the KV of full blocks for later prompts with the same prefix, so the router also
weighs, per worker, the blocks its cache holds (``routing/cache_view.py``): as the worker's own
events say (the same for every coordinator in front of the same workers), and, for the few
seconds before those events arrive or for a worker that publishes none, what this router sent
there (docs/architecture.md#routing). The choice itself (``routing/choice.py``) is a pure function
of those: a cached prefix draws requests until its worker is busier than the least loaded by the
configured imbalance, which then gets the next one (and caches the prefix too).

With ``kv_peer_pull`` the router also plans, for the prefill worker chosen, a pull of the
prefix another worker holds when its measured costs say the transfer beats the compute
(``routing/pull_cost.py``; ``take_pull``).

A worker that did not answer the last poll (busy, stopped, restarting) is *stale*: pairs of fresh
workers are chosen first, a stale worker only when no fresh pair is left, and a worker silent for
``STALE_GRACE_S`` is not chosen at all (NoWorkerError when nothing else is left). So a machine
too busy to answer a poll in time slows requests down instead of failing them.

No decode (or colocated) worker holds more than ``max_requests_per_worker`` requests at once:
this router's own, counted exactly from its choice to the request's end (``release``; a migrating
request keeps its place and moves it), and the other coordinators' on the worker as of the last
poll. A burst beyond what the pool can queue is refused at once (429) instead of waiting out its
timeout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from coordinator.errors import NoWorkerError, TooManyRequests
from coordinator.routing.cache_view import CacheView
from coordinator.routing.choice import Route, candidate_pairs, choose_pair
from coordinator.routing.config import RoutingConfig
from coordinator.routing.pull_cost import PullCosts, PullPlan
from coordinator.routing.tier_weights import tier_weights
from coordinator.routing.worker_state import WorkerKey, WorkerState
from coordinator.routing.worker_view import WorkerView
from engine.prefix_hash import block_hashes, tenant_root

MAX_PLANNED_PULLS = 4096  # pulls planned and not taken yet, at most


class Router:
    def __init__(
        self,
        fleet: Any,
        poll_interval_s: float | None = None,
        routing: RoutingConfig | None = None,
    ) -> None:
        """``poll_interval_s``: the load poll's pace (default: ``routing``'s
        ``load_poll_interval_ms``)."""
        self.routing = routing or RoutingConfig()
        self.cache = CacheView(self.routing.prefix_ttl_s)
        if poll_interval_s is None:
            poll_interval_s = self.routing.load_poll_interval_ms / 1000
        self.view = WorkerView(fleet, self.cache, poll_interval_s)
        self._holds: dict[str, WorkerState] = {}  # request id -> the decode worker holding it
        self.pull_costs = PullCosts()  # measured by the pulls made (routing/pull_cost.py)
        self._pulls: dict[str, PullPlan] = {}  # request id -> the pull its prefill should make

    def choose(
        self,
        token_ids: Sequence[int],
        exclude: AbstractSet[Route] = frozenset(),
        tenant: str = "",
        capped: bool = True,
        holder: str = "",
    ) -> Route:
        """The cheapest pair not in ``exclude`` for a request that computes ``token_ids``
        (prompt and outputs so far), fresh if possible (module docstring); NoWorkerError if none
        is left. The pair's workers are recorded as holding ``token_ids``' blocks from now on,
        as ``tenant``'s: only that tenant's later requests are drawn to them by it.

        In ``pd_separate`` the prefill side is None when the decode worker is to prefill the
        request itself (``local_prefill_*``; or no prefill worker answers and
        ``local_prefill_fallback`` is on); in ``single_node`` it is always 0.

        ``capped``: pairs whose decode worker holds ``max_requests_per_worker`` requests are
        left out, and TooManyRequests is raised when that leaves none (a migrating request, which
        holds its place already, is routed uncapped).

        ``holder``: the request's id; its place is counted on the chosen decode worker (moved
        there from its previous one) until ``release``."""
        now, routing, view = time.monotonic(), self.routing, self.view
        pairs = candidate_pairs(
            view.prefills, view.decodes, exclude, now, routing.local_prefill_fallback
        )
        if not pairs:
            raise NoWorkerError("no prefill/decode worker pair is available")
        cap = routing.max_requests_per_worker
        if capped and cap:
            pairs = [(p, d) for p, d in pairs if d.num_requests_held < cap]
            if not pairs:
                raise TooManyRequests("every worker holds as many requests as it may queue")
        hashes = (
            block_hashes(token_ids, routing.block_size, tenant_root(b"", tenant))
            if routing.prefix_routing
            else []
        )
        workers = {w.key: w for pair in pairs for w in pair if w is not None}
        cached = self._cached_tokens(workers, token_ids, hashes, tenant, now)
        # pd_separate: a decode worker prefills itself when no prefill worker serves (elastic
        # workers may all be decoding or switching)
        disaggregated = bool(view.prefills or view.elastic)
        choice = choose_pair(pairs, disaggregated, len(token_ids), cached, exclude, routing)
        if choice.prefill is not None:
            choice.prefill.pending_tokens += choice.prefill_tokens
        choice.decode.pending_tokens += choice.decode_prefill_tokens
        choice.decode.pending_requests += 1
        if holder:
            self.release(holder)
            self._holds[holder] = choice.decode
            choice.decode.num_own_requests += 1
        if routing.peer_pull and holder and choice.prefill is not None:
            self._plan_pull(holder, choice.prefill, workers, cached)
        for worker in (choice.prefill, choice.decode) if hashes else ():
            if worker is not None:
                self.cache.dispatched(worker.key, hashes, now, worker.stats.num_total_blocks)
        return choice.route

    def take_pull(self, holder: str) -> PullPlan | None:
        """The pull planned for request ``holder``'s prefill worker by its last ``choose``."""
        return self._pulls.pop(holder, None)

    def _plan_pull(
        self,
        holder: str,
        prefill: WorkerState,
        workers: dict[WorkerKey, WorkerState],
        cached: dict[WorkerKey, int],
    ) -> None:
        """Plan a pull for ``prefill`` from the worker holding the longest cached prefix when
        that beats computing it (``routing/pull_cost.py``)."""
        self._pulls.pop(holder, None)
        own = cached.get(prefill.key, 0)
        peers = [key for key in workers if key != prefill.key]
        source = max(peers, key=lambda key: cached[key], default=None)
        if source is None or cached[source] <= own:
            return
        block_size = self.routing.block_size
        gain = (cached[source] - own) // block_size
        block_s = prefill.stats.prompt_token_seconds * block_size
        if self.pull_costs.worth(gain, block_s):
            self._pulls[holder] = PullPlan(source, cached[source] // block_size)
            while len(self._pulls) > MAX_PLANNED_PULLS:  # plans no stream took: the oldest go
                self._pulls.pop(next(iter(self._pulls)))

    def release(self, holder: str) -> None:
        """Request ``holder`` is held by no worker any more (it ended, however it ended)."""
        worker = self._holds.pop(holder, None)
        if worker is not None:
            worker.num_own_requests -= 1

    def _cached_tokens(
        self,
        workers: dict[WorkerKey, WorkerState],
        token_ids: Sequence[int],
        hashes: list[bytes],
        tenant: str,
        now: float,
    ) -> dict[WorkerKey, int]:
        """Tokens of ``token_ids`` each worker should find cached (never the last one: the
        engines compute it); a block in one of its KV tiers counts for the share of its compute
        a load saves (``coordinator/routing/tier_weights.py``)."""
        block_size = self.routing.block_size
        max_blocks = max(len(token_ids) - 1, 0) // block_size
        cached = {}
        for key, worker in workers.items():
            weights = tier_weights(worker.stats, block_size)
            found = self.cache.num_cached(key, token_ids, hashes, tenant, now, block_size, weights)
            cached[key] = round(min(found, max_blocks) * block_size)
        return cached
