"""Owns the KV cache's block ids: reference counts, a free list, and the prefix cache.

A block is *in use* while some request holds it (its reference count is above zero). Blocks no
request holds are free; among them, those with prefix KV worth keeping stay *cached*, evictable
least recently freed first, and any request whose tokens start with them may take them back.

Prefix caching (``enabled``): once a block is full of computed KV it is registered under the hash of
its tokens chained from its parent block (``engine.prefix_hash``, rooted in the model fingerprint
and the request's tenant: a tenant's requests only ever find its own blocks). A new request takes
the longest run of cached blocks that starts its tokens (``match`` + ``take``), and computes the
rest. A hash match is confirmed by the block's own tokens and its parent's hash, so a collision can
never serve another prefix's KV (``num_collisions`` counts the ones caught). Cached free blocks
count as free for admission: ``allocate`` hands out never-used blocks first, then evicts cached
ones, oldest first (a session's blocks, ``prefer``, last); a block in use is never evicted. Each
hash cached and each one evicted is an event of ``events`` (``engine.kv_events``), which the
coordinators' routers mirror.

KV tiers (``engine.kv_tiers``, when configured): every cached block evicted is handed to
``on_evict`` first (its pages still intact), and :meth:`promote` extends a prefix the cache holds
with the blocks a tier holds, loaded into newly allocated blocks and cached like computed ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv_events import DEMOTED, REMOVED, STORED, KvEventLog, KvSnapshot, tier_kind
from engine.prefix_hash import extend_block_hashes, tenant_root

if TYPE_CHECKING:
    from engine.kv_tiers.tiers import KvTiers

MAX_TENANT_ROOTS = 4096  # tenants whose chain roots are kept computed
EvictedBlock = tuple[int, bytes, bytes, tuple[int, ...]]  # block id, hash, parent hash, tokens


@dataclass(frozen=True)
class CachedBlock:
    """What a cached block holds, to confirm a hash match."""

    block_id: int
    parent: bytes  # the preceding block's hash (the root for a first block)
    tokens: tuple[int, ...]


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enabled: bool = False, root: bytes = b""
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enabled = enabled  # prefix caching
        self.root = root  # the hash chain's start: the model fingerprint
        self._tenant_roots: dict[str, bytes] = {}
        self._empty: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first
        # free, cached, of a session (prefer): evicted only once no other cached block is left
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._preferred: dict[bytes, float] = {}  # block hash -> kept until (time.monotonic)
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for cached blocks
        self._cached: dict[bytes, CachedBlock] = {}
        self.num_collisions = 0
        self.num_queried_tokens = 0  # tokens looked up (counted once per admission)
        self.num_hit_tokens = 0  # of those, tokens found cached
        self.events = KvEventLog(root)  # what routers mirror (engine/kv_events.py)
        # evicted cached blocks as (block id, hash, parent hash, tokens), before their reuse; it
        # answers the tier each is kept in (None: not kept), for the events
        self.on_evict: Callable[[list[EvictedBlock]], list[str | None]] | None
        self.on_evict = None
        self.tiers: KvTiers | None = None  # where promote looks past the cache
        self.num_promoted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may be given: empty ones plus cached ones nobody uses."""
        return len(self._empty) + len(self._evictable) + len(self._kept)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def can_take(self, cached: Sequence[int], num_new: int) -> bool:
        """Whether ``cached`` (from :meth:`match`) plus ``num_new`` new blocks fit now."""
        return num_new + sum(1 for b in cached if self._refs[b] == 0) <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` blocks of no use to anyone, evicting cached ones if need be."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        evicted = []
        for _ in range(num_blocks):
            if self._empty:
                block_id = self._empty.popleft()
            else:
                free = self._evictable or self._kept
                block_id, _ = free.popitem(last=False)
                block_hash = self._hash_of.pop(block_id)
                entry = self._cached.pop(block_hash)
                evicted.append((block_id, block_hash, entry.parent, entry.tokens))
            self._refs[block_id] = 1
            block_ids.append(block_id)
        if evicted:
            kept: list[str | None] = [None] * len(evicted)
            if self.on_evict is not None:
                kept = self.on_evict(evicted)
            for (_, block_hash, *_), tier in zip(evicted, kept, strict=True):
                kind = tier_kind(DEMOTED, tier) if tier else REMOVED
                self.events.record(kind, block_hash)
        return block_ids

    def take(self, cached: Sequence[int]) -> list[int]:
        """Share the cached blocks ``cached`` (from :meth:`match`): one more user each."""
        for block_id in cached:
            if self._refs[block_id] == 0:
                (self._evictable if block_id in self._evictable else self._kept).pop(block_id)
            self._refs[block_id] += 1
        if self.tiers is not None:
            self.tiers.note_hits([self._hash_of[b] for b in cached if b in self._hash_of])
        return list(cached)

    def free(self, block_ids: list[int]) -> None:
        """Drop one user of each block and empty ``block_ids`` (the owner's list). A block
        nobody uses becomes free: cached (its tail first, so a prefix outlives its ends) or
        empty."""
        for block_id in reversed(block_ids):
            if self._refs[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed twice or never allocated")
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                if block_id in self._hash_of:
                    kept = self._preferred.get(self._hash_of[block_id], 0.0) > time.monotonic()
                    (self._kept if kept else self._evictable)[block_id] = None
                else:
                    self._empty.append(block_id)
        block_ids.clear()

    # ---- sessions ----------------------------------------------------------------------------

    def prefer(self, block_ids: Sequence[int], until: float) -> None:
        """Keep the cached blocks among ``block_ids`` (a session's: ``prompt_cache_key``) until
        ``until`` (``time.monotonic``): once free, they are evicted after every other cached
        block, and their tiers keep them likewise. Call it before freeing them."""
        for block_id in block_ids:
            block_hash = self._hash_of.get(block_id)
            if block_hash is not None:
                self._preferred[block_hash] = max(until, self._preferred.get(block_hash, 0.0))

    def is_preferred(self, block_hash: bytes) -> bool:
        return self._preferred.get(block_hash, 0.0) > time.monotonic()

    def expire_preferences(self, now: float) -> None:
        """Blocks whose session's time is over become evictable like any other."""
        if not self._preferred:
            return
        self._preferred = {h: t for h, t in self._preferred.items() if t > now}
        for block_id in [b for b in self._kept if self._hash_of[b] not in self._preferred]:
            del self._kept[block_id]
            self._evictable[block_id] = None

    # ---- the prefix cache ----------------------------------------------------------------------

    def root_of(self, tenant: str) -> bytes:
        """The hash chain's start for ``tenant``'s requests (no tenant: the model's root)."""
        root = self._tenant_roots.get(tenant)
        if root is None:
            if len(self._tenant_roots) >= MAX_TENANT_ROOTS:
                self._tenant_roots.clear()  # a cache of a pure function: recomputed at need
            root = self._tenant_roots[tenant] = tenant_root(self.root, tenant)
        return root

    def extend_hashes(
        self, hashes: list[bytes], token_ids: Sequence[int], num_tokens: int, tenant: str = ""
    ) -> list[bytes]:
        """Extend ``hashes`` (a request's, cached on it) to every full block of its first
        ``num_tokens`` tokens."""
        root = self.root_of(tenant)
        return extend_block_hashes(hashes, token_ids, self.block_size, root, num_tokens)

    def lookup(self, hashes: list[bytes], token_ids: Sequence[int], tenant: str = "") -> list[int]:
        """The cached blocks of the longest cached prefix of ``token_ids`` (``tenant``'s own),
        leaving at least the last token to compute (its logits are needed); extends ``hashes``
        as needed."""
        if not self.enabled:
            return []
        max_blocks = max(len(token_ids) - 1, 0) // self.block_size
        self.extend_hashes(hashes, token_ids, max_blocks * self.block_size, tenant)
        return self.match(hashes, token_ids, max_blocks, tenant)

    def count_lookup(self, num_tokens: int, num_cached_blocks: int) -> None:
        """Count one admission's lookup: ``num_tokens`` queried, that many blocks found."""
        if self.enabled:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_cached_blocks * self.block_size

    def match(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], max_blocks: int, tenant: str = ""
    ) -> list[int]:
        """The cached blocks holding the longest prefix of ``token_ids`` (at most
        ``max_blocks``) under ``tenant``'s root, each confirmed by its tokens and its parent's
        hash."""
        if not self.enabled:
            return []
        root = self.root_of(tenant)
        found: list[int] = []
        size = self.block_size
        for index, block_hash in enumerate(hashes[:max_blocks]):
            entry = self._cached.get(block_hash)
            if entry is None:
                break
            parent = hashes[index - 1] if index else root
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            if entry.parent != parent or entry.tokens != tokens:
                self.num_collisions += 1
                break
            found.append(entry.block_id)
        return found

    def promote(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], start: int, tenant: str = ""
    ) -> list[int]:
        """Blocks ``start``, ``start + 1``, ... of ``token_ids`` (``hashes`` from
        :meth:`lookup`, which leaves the last token to compute) that a tier holds, up to the first
        it does not: loaded into new blocks, cached under their hashes, one user each (the
        caller's). The caller has room for them (``can_take`` with every block it needs)."""
        if self.tiers is None or not self.enabled:
            return []
        stop = max(len(token_ids) - 1, 0) // self.block_size
        root = self.root_of(tenant)
        found = self.tiers.find(hashes, token_ids, start, stop, root, self.block_size)
        if not found:
            return []
        block_ids = self.allocate(len(found))
        self.tiers.load_into(block_ids, found)
        for block_id, block_hash, parent, tokens in zip(
            block_ids, found.hashes, found.parents, found.tokens, strict=True
        ):
            if block_hash in self._cached:
                continue  # the cache holds this block elsewhere: this copy stays private
            self._cached[block_hash] = CachedBlock(block_id, parent, tokens)
            self._hash_of[block_id] = block_hash
            self.events.record(STORED, block_hash)
        self.num_promoted_blocks += len(block_ids)
        return block_ids

    def register(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        tenant: str = "",
    ) -> None:
        """Cache the full, computed blocks ``block_ids[start:len(hashes)]`` of a request (of
        ``tenant``) under their hashes. A hash already cached keeps its block (this copy stays
        private); a hash cached for another prefix (a collision) ends the registration there."""
        if not self.enabled:
            return
        size, root = self.block_size, self.root_of(tenant)
        for index in range(start, min(len(hashes), len(block_ids))):
            block_id, block_hash = block_ids[index], hashes[index]
            parent = hashes[index - 1] if index else root
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            entry = self._cached.get(block_hash)
            if entry is not None and (entry.parent, entry.tokens) != (parent, tokens):
                self.num_collisions += 1  # another prefix holds this hash: nothing after it
                return  # may be registered, or a block would be found under a wrong parent
            if block_id in self._hash_of or entry is not None:
                continue
            self._cached[block_hash] = CachedBlock(block_id, parent, tokens)
            self._hash_of[block_id] = block_hash
            self.events.record(STORED, block_hash)
            if self.tiers is not None:
                self.tiers.note_cached([block_hash])

    def cached_block(self, block_hash: bytes) -> EvictedBlock | None:
        """The cached block of ``block_hash`` as ``(block id, hash, parent hash, tokens)``."""
        entry = self._cached.get(block_hash)
        return None if entry is None else (entry.block_id, block_hash, entry.parent, entry.tokens)

    def kv_snapshot(self) -> KvSnapshot:
        """Every cached hash as of the latest event (call it where the blocks change), and the
        blocks the tiers hold."""
        tiered = self.tiers.held() if self.tiers is not None else ()
        return self.events.snapshot(list(self._cached), tiered)
