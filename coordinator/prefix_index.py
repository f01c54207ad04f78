"""What the router sent where: per worker, the block hashes of the token sequences it routed
there, the router's estimate of that worker's prefix cache.

A sequence's hashes are those of ``engine.prefix_hash`` rooted at ``b""`` (the coordinator does not
know the engines' model fingerprint, so they never equal an engine's own: they only name prefixes
here), or at ``tenant_root(b"", tenant)`` for a tenant's request, as the engines root theirs: one
tenant's prefixes never draw another tenant's requests. A worker's entries are kept least recently
used first and bounded by its capacity (its KV blocks); an entry not routed again within ``ttl_s``
expires. An estimate only: an engine may have evicted a block the index still holds, and the router
only weighs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

WorkerKey = tuple[str, int]  # (role, instance)
DEFAULT_CAPACITY_BLOCKS = 4096  # a worker whose KV block count is not known yet


class PrefixIndex:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # per worker: block hash -> when it was last routed there, least recently used first
        self._entries: dict[WorkerKey, OrderedDict[bytes, float]] = {}

    def num_entries(self, worker: WorkerKey) -> int:
        return len(self._entries.get(worker, ()))

    def match(
        self,
        worker: WorkerKey,
        hashes: Sequence[bytes],
        now: float,
        max_age_s: float | None = None,
    ) -> int:
        """How many leading blocks of ``hashes`` the worker holds (unexpired; with
        ``max_age_s``, routed there within that many seconds)."""
        entries = self._entries.get(worker)
        if not entries:
            return 0
        self._expire(entries, now)
        oldest = now - max_age_s if max_age_s is not None else float("-inf")
        count = 0
        for block_hash in hashes:
            routed_at = entries.get(block_hash)
            if routed_at is None or routed_at < oldest:
                break
            count += 1
        return count

    def insert(
        self, worker: WorkerKey, hashes: Sequence[bytes], now: float, capacity: int = 0
    ) -> None:
        """Record that the worker holds ``hashes`` (a sequence's leading blocks) as of ``now``;
        evicts its least recently used entries beyond ``capacity`` (0: the default)."""
        entries = self._entries.setdefault(worker, OrderedDict())
        for block_hash in reversed(hashes):  # the tail first: a prefix outlives its ends
            entries[block_hash] = now
            entries.move_to_end(block_hash)
        self._expire(entries, now)
        limit = capacity if capacity > 0 else DEFAULT_CAPACITY_BLOCKS
        while len(entries) > limit:
            entries.popitem(last=False)

    def drop(self, worker: WorkerKey) -> None:
        """Forget everything about the worker (it restarted, was lost, or has no cache)."""
        self._entries.pop(worker, None)

    def _expire(self, entries: OrderedDict[bytes, float], now: float) -> None:
        while entries and now - next(iter(entries.values())) > self.ttl_s:
            entries.popitem(last=False)
