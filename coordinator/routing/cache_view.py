"""What each worker's prefix cache holds, as far as the router can tell: one view per worker.

**Confirmed**: the worker's own events. Every worker numbers the block hashes its cache stores
and evicts (``engine.kv_events``); each load poll, and each router's long poll of a worker, brings
the events after the last one applied here (an event that arrives twice applies once), so every
coordinator in front of the same workers holds the same picture, whoever routed the requests. A
worker's first poll, a worker that restarted (a new *epoch*) and a gap in the numbers (the worker
no longer holds the events missed) each make the view load a snapshot of that worker's cache
instead (a *resync*); the events that follow apply on top of it. Until then that worker counts as
confirming nothing: a resync can cost a cache hit, never send a request to a worker for blocks it
does not hold. These hashes are the engines' own (rooted in the model fingerprint each worker
reports, and the tenant, as ``engine.prefix_hash`` roots them), bounded by the worker's blocks.
A block the worker demoted to one of its KV tiers (``engine/kv_tiers``: a ``demoted:<tier>``
event) stays the worker's, in that tier, until a ``dropped:<tier>`` event says it lost it: a
demotion is never a removal. A prefix counts each leading block the cache holds as one, and each
one a tier holds as that tier's weight (``coordinator/routing/tier_weights.py``: the compute its
load saves, as the worker measures both).

**Dispatched**: what this router sent there and the events have not confirmed yet. These hashes
are rooted at ``b""`` (or ``tenant_root(b"", tenant)``: one tenant's prefixes never draw another
tenant's requests), kept least recently used first, bounded by the worker's capacity, and expire
``ttl_s`` after they were last sent. For a worker that confirms (publishes events), a dispatch
counts only for ``ROUTED_HINT_S``, until its events arrive; for one that publishes none, the
dispatches are all there is.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.routing.worker_state import WorkerKey
from engine.kv_events import DEMOTED, DROPPED, REMOVED, STORED, KvEventBatch, KvSnapshot, split_kind
from engine.prefix_hash import block_hashes, tenant_root

ROUTED_HINT_S = 5.0  # a dispatch to a worker with events counts this long
DEFAULT_CAPACITY_BLOCKS = 4096  # a worker whose KV block count is not known yet
MAX_TIERED_BLOCKS = 1 << 17  # a worker's tier blocks kept, at most (the oldest go)


@dataclass
class WorkerCache:
    epoch: str = ""
    root: bytes = b""
    seq: int = -1  # the last event applied (-1: waiting for a snapshot)
    hashes: set[bytes] = field(default_factory=set)  # confirmed
    tiered: dict[bytes, str] = field(default_factory=dict)  # confirmed in a tier: hash -> tier
    # dispatched: block hash (rooted at b"") -> when last sent, least recently sent first
    routed: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    @property
    def confirms(self) -> bool:
        return self.seq >= 0

    def forget_events(self, epoch: str, root: bytes) -> None:
        self.epoch, self.root, self.seq = epoch, root, -1
        self.hashes.clear()
        self.tiered.clear()


class CacheView:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._workers: dict[WorkerKey, WorkerCache] = {}
        self.num_events = 0  # events applied
        self.num_resyncs = 0  # snapshots loaded after a gap or a new epoch

    # ---- the workers' events ---------------------------------------------------------------------

    def cursor(self, worker: WorkerKey) -> tuple[str, int]:
        """What to ask ``worker`` for: events after (epoch, seq); seq -1 means none known."""
        cache = self._workers.get(worker)
        return (cache.epoch, cache.seq) if cache is not None else ("", -1)

    def cursors(self) -> dict[WorkerKey, tuple[str, int]]:
        return {key: (c.epoch, c.seq) for key, c in self._workers.items() if c.epoch}

    def apply(self, worker: WorkerKey, batch: KvEventBatch, capacity: int = 0) -> bool:
        """Apply a poll's events; True when the worker must be resynchronised from a snapshot
        (a gap, another epoch, a first poll, or more hashes than its ``capacity`` blocks).
        A batch with no epoch is a worker that publishes no events: nothing to do."""
        if not batch.epoch:
            return False
        cache = self._workers.setdefault(worker, WorkerCache())
        if batch.gap or batch.epoch != cache.epoch or not cache.confirms:
            cache.forget_events(batch.epoch, batch.root)
            return True
        for seq, kind, block_hash in batch.events:
            if seq <= cache.seq:  # applied already (a load poll and a long poll overlap)
                continue
            if seq != cache.seq + 1:  # never applied out of order
                cache.forget_events(batch.epoch, batch.root)
                return True
            _apply_event(cache, kind, block_hash)
            cache.seq = seq
            self.num_events += 1
        if capacity and len(cache.hashes) > capacity:
            cache.forget_events(batch.epoch, batch.root)
            return True
        return False

    def load(self, worker: WorkerKey, snapshot: KvSnapshot) -> None:
        """Start ``worker``'s confirmed hashes over from ``snapshot`` (its events follow)."""
        cache = self._workers.setdefault(worker, WorkerCache())
        cache.epoch, cache.root, cache.seq = snapshot.epoch, snapshot.root, snapshot.seq
        cache.hashes = set(snapshot.hashes)
        cache.tiered = dict(snapshot.tiered)
        self.num_resyncs += 1

    def match_confirmed(
        self, worker: WorkerKey, hashes: Sequence[bytes], weights: Mapping[str, float] = {}
    ) -> float:
        """Leading blocks of ``hashes`` (rooted at the worker's root) its events confirm: one
        for each in its cache, its tier's weight (``weights``) for each in a tier."""
        cache = self._workers.get(worker)
        if cache is None or not cache.confirms:
            return 0
        found = 0.0
        for block_hash in hashes:
            if block_hash in cache.hashes:
                found += 1
            elif block_hash in cache.tiered:
                found += weights.get(cache.tiered[block_hash], 0.0)
            else:
                break
        return found

    # ---- this router's dispatches ----------------------------------------------------------------

    def dispatched(
        self, worker: WorkerKey, hashes: Sequence[bytes], now: float, capacity: int = 0
    ) -> None:
        """Record that ``hashes`` (a sequence's leading blocks, rooted at ``b""``) were sent to
        ``worker`` at ``now``; its least recently sent beyond ``capacity`` (0: the default) go."""
        routed = self._workers.setdefault(worker, WorkerCache()).routed
        for block_hash in reversed(hashes):  # the tail first: a prefix outlives its ends
            routed[block_hash] = now
            routed.move_to_end(block_hash)
        self._expire(routed, now)
        limit = capacity if capacity > 0 else DEFAULT_CAPACITY_BLOCKS
        while len(routed) > limit:
            routed.popitem(last=False)

    def num_dispatched(self, worker: WorkerKey) -> int:
        cache = self._workers.get(worker)
        return len(cache.routed) if cache is not None else 0

    def forget_dispatches(self, worker: WorkerKey) -> None:
        """The worker's cache is gone (it restarted, or is idle with none): what was sent there
        is not."""
        cache = self._workers.get(worker)
        if cache is not None:
            cache.routed.clear()

    def match_dispatched(
        self, worker: WorkerKey, hashes: Sequence[bytes], now: float, max_age_s: float | None = None
    ) -> int:
        """Leading blocks of ``hashes`` sent to ``worker`` and not expired (with ``max_age_s``,
        sent within that many seconds)."""
        cache = self._workers.get(worker)
        if cache is None or not cache.routed:
            return 0
        self._expire(cache.routed, now)
        oldest = now - max_age_s if max_age_s is not None else float("-inf")
        routed = cache.routed
        return _leading(hashes, lambda h: h in routed and routed[h] >= oldest)

    # ---- both ------------------------------------------------------------------------------------

    def num_cached(
        self,
        worker: WorkerKey,
        token_ids: Sequence[int],
        routed_hashes: Sequence[bytes],
        tenant: str,
        now: float,
        block_size: int,
        weights: Mapping[str, float] = {},
    ) -> float:
        """Leading blocks of ``token_ids`` the worker should find cached: what its events
        confirm (its tiers' blocks by ``weights``), or what was sent there lately (any time
        before expiry, for a worker without events). ``routed_hashes``: the dispatch hashes of
        ``token_ids`` (none: nothing)."""
        if not routed_hashes:
            return 0
        cache = self._workers.get(worker)
        if cache is None or not cache.confirms:
            return self.match_dispatched(worker, routed_hashes, now)
        recent = self.match_dispatched(worker, routed_hashes, now, max_age_s=ROUTED_HINT_S)
        hashes = block_hashes(token_ids, block_size, tenant_root(cache.root, tenant))
        return max(self.match_confirmed(worker, hashes, weights), recent)

    def drop(self, worker: WorkerKey) -> None:
        """Forget everything about the worker (lost: back, if ever, with an empty cache)."""
        self._workers.pop(worker, None)

    def _expire(self, routed: OrderedDict[bytes, float], now: float) -> None:
        while routed and now - next(iter(routed.values())) > self.ttl_s:
            routed.popitem(last=False)


def _apply_event(cache: WorkerCache, kind: str, block_hash: bytes) -> None:
    base, tier = split_kind(kind)
    if base == STORED:
        cache.hashes.add(block_hash)
        cache.tiered.pop(block_hash, None)
    elif base == REMOVED:
        cache.hashes.discard(block_hash)
    elif base == DEMOTED:
        cache.hashes.discard(block_hash)
        cache.tiered.pop(block_hash, None)
        cache.tiered[block_hash] = tier  # the newest last
        if len(cache.tiered) > MAX_TIERED_BLOCKS:
            del cache.tiered[next(iter(cache.tiered))]
    elif base == DROPPED and cache.tiered.get(block_hash) == tier:
        del cache.tiered[block_hash]


def _leading(hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many of the leading ``hashes`` are ``held``."""
    return sum(1 for _ in itertools.takewhile(held, hashes))
