"""Load- and cache-aware choice of the (prefill, decode) pair for each request.

Worker loads are polled in the background; between polls the router counts what it dispatched
itself, so a burst of requests spreads out instead of piling onto the worker that looked idle at
the last poll. Prefill load: prompt tokens queued. Decode load: running requests.

Engines keep the KV of full blocks for later prompts with the same prefix, so the router also
weighs, per worker, the blocks its cache holds: as the worker's own events say
(``coordinator.kv_index``, the same for every coordinator in front of the same workers; they
come with each load poll and, while other coordinators share the workers, within
~``FOLLOW_BATCH_S`` from a long poll of each worker), and, for
the few seconds before those events arrive (``ROUTED_HINT_S``) or for a worker that publishes
none, what this router sent there (``coordinator.prefix_index``) (docs/architecture.md#routing):

- a prefill worker costs its load plus the tokens it would compute, ``num_tokens`` less its
  cached prefix; among workers whose load is within ``max_prefill_imbalance`` tokens of the least
  loaded one, the cheapest wins (the others only by load);
- a decode worker (the colocated one in ``single_node``, which also computes the prompt) whose
  running requests are within ``max_decode_imbalance`` of the least loaded one is ranked by its
  cached prefix, longest first, then by load, then by free blocks; the others only by load.

So a cached prefix draws requests until its worker is that much busier than the least loaded,
which then gets the next one (and caches the prefix too). The index entries of a worker that
restarted (another pid) or was lost, or of an idle one that reports no cached block, are dropped.

A worker that did not answer the last poll (busy, stopped, restarting) is *stale*: pairs of fresh
workers are chosen first, a stale worker only when no fresh pair is left, and a worker silent for
``STALE_GRACE_S`` is not chosen at all (NoWorkerError when nothing else is left). So a machine
too busy to answer a poll in time slows requests down instead of failing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import NoWorkerError
from coordinator.kv_index import KvIndex
from coordinator.prefix_index import PrefixIndex, WorkerKey
from engine.config import CacheConfig
from engine.errors import ConfigError
from engine.outputs import EngineStats
from engine.prefix_hash import block_hashes, tenant_root
from workers.contracts import WorkerLoad, WorkerReport

log = logging.getLogger(__name__)
STALE_GRACE_S = 30.0
# a worker whose events this router mirrors: what was routed there counts this long (until the
# worker's own events say what it cached)
ROUTED_HINT_S = 5.0
# while other coordinators share the workers, each worker's prefix-cache events are also
# followed by a long poll: it waits up to FOLLOW_WAIT_S for the next event and returns at most
# every FOLLOW_BATCH_S (events batch up meanwhile), so a block stored on a worker reaches every
# router within ~FOLLOW_BATCH_S, not at its next load poll
FOLLOW_WAIT_S = 2.0
FOLLOW_BATCH_S = 0.1


@dataclass(frozen=True)
class RoutingConfig:
    """How the router weighs cached prefixes (module docstring); built from
    ``digs_scheduler_config`` and ``backend_config`` by ``served_model.routing_config``."""

    prefix_routing: bool = True  # False: pairs by load only
    block_size: int = CacheConfig.block_size  # the engines' cacheBlockSize
    max_prefill_imbalance: int = 8192  # queued prompt tokens over the least loaded prefill
    max_decode_imbalance: int = 4  # running requests over the least loaded decode
    prefix_ttl_s: float = 600.0  # an index entry not routed again for this long expires
    # pd_separate: the decode worker prefills a prompt itself (no hand-off) when what it would
    # compute is at most local_prefill_tokens (0: never), or is less than the chosen prefill
    # worker's queue once that queue reaches local_prefill_queue_tokens (0: never)
    local_prefill_tokens: int = 96
    local_prefill_queue_tokens: int = 1024
    local_prefill_fallback: bool = True  # no prefill worker answers: decode workers prefill

    def __post_init__(self) -> None:
        for name in ("block_size", "prefix_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"routing {name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_prefill_imbalance",
            "max_decode_imbalance",
            "local_prefill_tokens",
            "local_prefill_queue_tokens",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be at least 0, got {getattr(self, name)}")


@dataclass
class WorkerState:
    role: str
    instance: int
    stats: EngineStats = field(default_factory=EngineStats)  # as of the last poll
    pending_tokens: int = 0  # tokens to compute dispatched here since the last poll
    pending_requests: int = 0
    fresh: bool = True  # answered the last poll
    last_seen: float = field(default_factory=time.monotonic)
    pid: int = 0  # of its actor at the last poll (0: not heard from yet)

    @property
    def key(self) -> WorkerKey:
        return (self.role, self.instance)

    def reachable(self, now: float) -> bool:
        return self.fresh or now - self.last_seen < STALE_GRACE_S

    @property
    def prefill_cost(self) -> float:
        return self.stats.num_prompt_tokens_to_compute + self.pending_tokens

    @property
    def decode_load(self) -> int:
        stats = self.stats
        return stats.num_running + stats.num_reserved + self.pending_requests


Pair = tuple[WorkerState | None, WorkerState]  # (None, colocated worker) in single_node
# (prefill instance, decode instance); prefill None: the decode worker prefills it itself
Route = tuple[int | None, int]


class Router:
    def __init__(
        self,
        fleet: Any,
        poll_interval_s: float = 0.25,
        routing: RoutingConfig | None = None,
    ) -> None:
        self.fleet = fleet  # the workers it routes to (coordinator.pool.fleet.Fleet)
        self.poll_interval_s = poll_interval_s
        self.routing = routing or RoutingConfig()
        self.index = PrefixIndex(self.routing.prefix_ttl_s)  # what this router sent where
        self.kv = KvIndex()  # what the workers' events say they cache
        self.prefills: list[WorkerState] = []
        self.decodes: list[WorkerState] = []
        self._task: asyncio.Task | None = None
        self._followers: list[asyncio.Task] = []
        self.latest_loads: list[WorkerLoad] = []
        self.latest_reports: list[WorkerReport] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._poll_forever())
        self._bind()
        workers = [*self.prefills, *self.decodes]
        self._followers = [loop.create_task(self._follow_forever(w)) for w in workers]

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._followers) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _bind(self) -> None:
        """Worker states for the fleet's actors (known once it has started)."""
        fleet = self.fleet
        single = fleet.config.deploy_mode == "single_node"
        if not self.decodes:
            self.prefills = [WorkerState("prefill", i) for i in range(len(fleet.prefills))]
            count = len(fleet.colocated if single else fleet.decodes)
            self.decodes = [
                WorkerState("colocated" if single else "decode", i) for i in range(count)
            ]

    async def refresh(self) -> list[WorkerLoad]:
        self._bind()
        reports = await self.fleet.reports(self.kv.cursors())
        loads = [report.load for report in reports]
        self.latest_loads = loads
        self.latest_reports = reports
        seen = {(load.role, load.instance) for load in loads}
        now = time.monotonic()
        for worker in [*self.prefills, *self.decodes]:
            worker.fresh = worker.key in seen
            if worker.fresh:
                worker.last_seen = now
            elif not worker.reachable(now):
                self.index.drop(worker.key)  # lost: back, if ever, with an empty cache
                self.kv.drop(worker.key)
        for report in reports:
            load = report.load
            state = self._state(load.role, load.instance)
            if state is not None:
                self._forget_lost_cache(state, load)
                state.stats, state.pending_tokens, state.pending_requests = load.stats, 0, 0
                state.pid = load.pid
                await self._follow_events(state, report)
        return loads

    async def _follow_forever(self, state: WorkerState) -> None:
        """Long-poll ``state``'s worker for its prefix-cache events and apply them as they come
        (a gap or another epoch is left to the load poll, which resynchronises)."""
        while True:
            epoch, seq = self.kv.cursor(state.key)
            if seq < 0 or not state.fresh or not self._shared():
                # not in sync yet, not answering, or no other coordinator routes to the workers
                # (what this one routed counts at once): the load poll's events suffice
                await asyncio.sleep(self.poll_interval_s)
                continue
            try:
                batch = await self.fleet.kv_events(*state.key, epoch, seq, FOLLOW_WAIT_S)
            except Exception as exc:  # dead or restarting: the load poll notices it
                log.debug("events of %s worker %d: %r", *state.key, exc)
                await asyncio.sleep(self.poll_interval_s)
                continue
            if not batch.gap and batch.epoch == self.kv.cursor(state.key)[0]:
                self.kv.apply(state.key, batch, state.stats.num_total_blocks)
            await asyncio.sleep(FOLLOW_BATCH_S)

    def _shared(self) -> bool:
        """Whether another coordinator holds a lease on any worker, as of the last poll."""
        return any(report.num_coordinators > 1 for report in self.latest_reports)

    async def _follow_events(self, state: WorkerState, report: WorkerReport) -> None:
        """Apply a worker's prefix-cache events; after a gap or a restart, load its snapshot
        (a failed snapshot is asked for again at the next poll)."""
        if not self.kv.apply(state.key, report.kv_events, state.stats.num_total_blocks):
            return
        try:
            snapshot = await self.fleet.kv_snapshot(*state.key)
        except Exception as exc:  # the next poll reports the gap again
            log.warning("prefix cache snapshot of %s worker %d failed: %r", *state.key, exc)
            return
        self.kv.load(state.key, snapshot)
        log.info(
            "%s worker %d: prefix index resynchronised (%d blocks, event %d)",
            *state.key,
            len(snapshot.hashes),
            snapshot.seq,
        )

    def _forget_lost_cache(self, state: WorkerState, load: WorkerLoad) -> None:
        """Drop the index entries of a worker whose cache is gone: its actor restarted, or it is
        idle (nothing on its way to it either) and reports no cached block."""
        restarted = state.pid != 0 and load.pid != state.pid
        sent = state.pending_tokens or state.pending_requests  # maybe not there at the poll
        emptied = load.stats.num_cached_blocks == 0 and _is_idle(load.stats) and not sent
        if (restarted or emptied) and self.index.num_entries(state.key):
            why = f"restarted (pid {state.pid} -> {load.pid})" if restarted else "has no cache"
            log.info("%s worker %d %s: its prefix index is dropped", *state.key, why)
            self.index.drop(state.key)

    def _state(self, role: str, instance: int) -> WorkerState | None:
        pool = self.prefills if role == "prefill" else self.decodes
        return pool[instance] if instance < len(pool) else None

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a poll must never kill the router
                log.exception("load poll failed")
            await asyncio.sleep(self.poll_interval_s)

    def choose(
        self,
        token_ids: Sequence[int],
        exclude: AbstractSet[Route] = frozenset(),
        tenant: str = "",
    ) -> Route:
        """The cheapest pair not in ``exclude`` for a request that computes ``token_ids``
        (prompt and outputs so far), fresh if possible (module docstring); NoWorkerError if none
        is left. The pair's workers are recorded as holding ``token_ids``' blocks from now on,
        as ``tenant``'s: only that tenant's later requests are drawn to them by it.

        In ``pd_separate`` the prefill side is None when the decode worker is to prefill the
        request itself (``local_prefill_*``; or no prefill worker answers and
        ``local_prefill_fallback`` is on); in ``single_node`` it is always 0."""
        now = time.monotonic()
        pairs = self._candidates(exclude, now)
        if not pairs:
            raise NoWorkerError("no prefill/decode worker pair is available")
        routing = self.routing
        hashes = (
            block_hashes(token_ids, routing.block_size, tenant_root(b"", tenant))
            if routing.prefix_routing
            else []
        )
        max_blocks = max(len(token_ids) - 1, 0) // routing.block_size  # engines compute the last
        keys = {w.key for pair in pairs for w in pair if w is not None}
        cached = {  # tokens each worker should find cached
            key: min(self._num_cached(key, token_ids, hashes, tenant, now), max_blocks)
            * routing.block_size
            for key in keys
        }
        least = (min(_prefill_load(p) for p, _ in pairs), min(d.decode_load for _, d in pairs))
        p, d = min(pairs, key=lambda pair: self._cost(pair, len(token_ids), cached, least))
        local = p is None and bool(self.prefills)
        num_local = len(token_ids) - cached[d.key]  # what the decode worker would compute
        locally = p is not None and self._prefill_locally(p, d, num_local)
        if locally and (None, d.instance) not in exclude:
            p, local = None, True
        if p is not None:
            p.pending_tokens += len(token_ids) - cached[p.key]
        elif local:
            d.pending_tokens += num_local
        d.pending_requests += 1
        for worker in (p, d) if hashes else ():
            if worker is not None:
                self.index.insert(worker.key, hashes, now, worker.stats.num_total_blocks)
        return (None if local else p.instance if p else 0, d.instance)

    def _num_cached(
        self,
        key: WorkerKey,
        token_ids: Sequence[int],
        routed_hashes: list[bytes],
        tenant: str,
        now: float,
    ) -> int:
        """Leading blocks of ``token_ids`` worker ``key`` should find cached: what its events
        say, or what was routed there lately (any time, for a worker without events)."""
        if not routed_hashes:
            return 0
        root = self.kv.root(key)
        if root is None:
            return self.index.match(key, routed_hashes, now)
        hashes = block_hashes(token_ids, self.routing.block_size, tenant_root(root, tenant))
        recent = self.index.match(key, routed_hashes, now, max_age_s=ROUTED_HINT_S)
        return max(self.kv.match(key, hashes), recent)

    def _candidates(self, exclude: AbstractSet[Route], now: float) -> list[Pair]:
        """Fresh pairs; else, when no prefill worker answers (pd_separate,
        ``local_prefill_fallback``), fresh decode workers that prefill locally; else pairs of
        workers not yet given up on."""
        fresh = self._pairs(exclude, lambda w: w.fresh)
        prefill_answers = any(p.fresh for p in self.prefills)
        if fresh or prefill_answers or not self.prefills or not self.routing.local_prefill_fallback:
            return fresh or self._pairs(exclude, lambda w: w.reachable(now))
        local: list[Pair] = [
            (None, d) for d in self.decodes if d.fresh and (None, d.instance) not in exclude
        ]
        return local or self._pairs(exclude, lambda w: w.reachable(now))

    def _prefill_locally(self, p: WorkerState, d: WorkerState, num_local_tokens: int) -> bool:
        """Whether decode worker ``d`` computes the prompt itself: ``num_local_tokens`` (what
        it would compute) is short, or shorter than prefill worker ``p``'s long queue. Either
        way only while ``d``'s own prompt tokens to compute, this prompt's included, stay within
        the short limit or below ``p``'s queue: a decode worker that is already prefilling
        would slow its streams for longer than a hand-off takes."""
        routing = self.routing
        backlog = d.prefill_cost + num_local_tokens
        short = routing.local_prefill_tokens
        if short and num_local_tokens <= short and backlog <= max(short, p.prefill_cost):
            return True
        queue = routing.local_prefill_queue_tokens
        return bool(queue) and p.prefill_cost >= queue and backlog < p.prefill_cost

    def _cost(
        self,
        pair: Pair,
        num_tokens: int,
        cached: dict[WorkerKey, int],
        least: tuple[float, int],
    ) -> tuple[float, ...]:
        """A pair's cost, prefill first (module docstring), given the least prefill and decode
        loads among the candidates. Without cached prefixes (or with ``prefix_routing`` off) it
        orders pairs as their loads alone do."""
        p, d = pair
        least_prefill, least_decode = least
        if p is None:
            prefill: tuple[float, ...] = (0, 0)
        elif p.prefill_cost > least_prefill + self.routing.max_prefill_imbalance:
            prefill = (1, p.prefill_cost)
        else:
            prefill = (0, p.prefill_cost + num_tokens - cached[p.key])
        free = -d.stats.num_free_blocks
        if d.decode_load > least_decode + self.routing.max_decode_imbalance:
            return (*prefill, 1, 0, d.decode_load, free)
        return (*prefill, 0, -cached[d.key], d.decode_load, free)

    def _pairs(
        self, exclude: AbstractSet[Route], usable: Callable[[WorkerState], bool]
    ) -> list[Pair]:
        prefills: list[WorkerState | None] = [p for p in self.prefills if usable(p)]
        if not self.prefills:  # single_node: the colocated worker does it all
            prefills = [None]
        return [
            (p, d)
            for p in prefills
            for d in self.decodes
            if usable(d)
            and (p.instance if p else 0, d.instance) not in exclude
            and (None, d.instance) not in exclude  # failed prefilling there itself
        ]


def _prefill_load(worker: WorkerState | None) -> float:
    return worker.prefill_cost if worker is not None else 0


def _is_idle(stats: EngineStats) -> bool:
    return stats.num_waiting + stats.num_running + stats.num_held + stats.num_reserved == 0
