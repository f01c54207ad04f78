"""The KV tiers under a worker's paged cache: blocks its prefix cache evicts are demoted to the
node-shared tier (shared memory) and, once worth it, to the disk tier; a prompt whose prefix a
tier holds is served from there instead of computed.

**Demotion.** When the block manager evicts a cached block to reuse it, the engine thread copies
the block's KV pages out (one copy for the step's evicted blocks, before the step's forward
overwrites them) and queues them; a writer thread encodes and writes the files, off the step. A
block goes to the node-shared tier always, and to the disk tier once admitted: it was demoted
``disk_admit_after`` times, or reused before (from the cache or a tier: the blocks that come back
are the ones worth a disk write). An idle worker also writes the reused blocks its cache still
holds that the disk tier lacks (:meth:`KvTiers.checkpoint`), so that a restart, even a crash,
finds them. Demotions past ``max_pending_bytes`` waiting for the writer, and writes that fail
(disk full, I/O errors), are skipped and counted: a request never waits for a tier.

**Promotion.** At admission, after the device cache's own prefix, the following blocks of the
prompt are looked up in the node-shared tier, then on disk; the run of blocks found (each checked
whole, and against its parent hash and tokens) is loaded into free blocks, cached there like any
computed block, and counts as cached tokens; the request computes only the rest. The files are
read straight into one tensor and checked by two loader threads while the engine thread waits
(it computes nothing meanwhile), then copied into the cache's blocks at once.

Keys are the prefix cache's chained block hashes (model fingerprint, dtype and tenant in their
root) inside a folder per KV layout: a block of another model, tenant or layout never matches.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_events import DEMOTED, DROPPED, KvEventLog, tier_kind
from engine.kv_tiers.block_file import BlockRecord, CorruptBlock
from engine.kv_tiers.file_tier import FileTier, TierStats
from engine.transfer.codec import byte_view

MAX_REMEMBERED = 1 << 16  # block hashes whose demotions and hits are counted for admission
MAX_SNAPSHOT = 1 << 16  # tier blocks a snapshot of the cache names, at most
LOAD_THREADS = 2  # threads reading a prompt's tier blocks (the engine thread waits meanwhile)
LOAD_CHUNK = 8  # blocks read per round after the first: a miss stops the reads at its round
STAGING_BYTES = 64 << 20  # the staging buffer's size, at most (a longer run gets a fresh one)
EvictedBlock = tuple[int, bytes, bytes, tuple[int, ...]]  # block id, hash, parent hash, tokens


@dataclass(frozen=True)
class TierSettings:
    host_bytes: int = 0  # the node-shared tier's cap (0: no such tier)
    host_path: Path = Path("/dev/shm/pdserve-kv")
    disk_bytes: int = 0  # the disk tier's cap (0: no such tier)
    disk_path: Path | None = None
    disk_admit_after: int = 2  # demotions of a block before it is written to disk
    max_pending_bytes: int = 64 << 20  # demoted KV waiting for the writer, at most

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0


class KvTiers:
    def __init__(
        self,
        settings: TierSettings,
        layout_key: str,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        export: Callable[[list[int]], torch.Tensor],
        load: Callable[[list[int], torch.Tensor], None],
        pinned: bool = False,
    ) -> None:
        """``page_shape`` and ``dtype``: one block's pages as ``export`` gives them and ``load``
        takes them (``[layers, 2, 1, block_size, kv_heads, head_dim]``). ``pinned``: the cache
        is on a GPU; promotions stage the pages in pinned host memory."""
        self.settings = settings
        self.host = (
            FileTier("host", settings.host_path, settings.host_bytes, layout_key)
            if settings.host_bytes
            else None
        )
        self.disk = None
        if settings.disk_bytes:
            if settings.disk_path is None:
                raise ValueError("a disk tier needs a folder (kv_disk_tier_path)")
            self.disk = FileTier("disk", settings.disk_path, settings.disk_bytes, layout_key)
        self._export, self._load = export, load
        self.events: KvEventLog | None = None  # the cache's, told what the tiers lose
        for tier in self.tiers:
            tier.on_drop = lambda block_hash, tier=tier: self._dropped(block_hash, tier)
        self._page_shape, self._dtype = page_shape, dtype
        layers, two, _, *rest = page_shape
        self._unit_shape = (layers, two, *rest)  # one block's pages, its block axis dropped
        self._block_bytes = math.prod(page_shape) * dtype.itemsize
        # promotion reads files and checks them on these threads, the engine thread waiting
        self._loaders = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-tier-load")
        self._staging: torch.Tensor | None = None  # where promotions read files (find)
        self.pinned = pinned
        self._copied: torch.cuda.Event | None = None  # the GPU's copy out of the staging buffer
        self._demotions: OrderedDict[bytes, int] = OrderedDict()
        self._hit: OrderedDict[bytes, None] = OrderedDict()  # reused: from the cache or a tier
        self._due: OrderedDict[bytes, None] = OrderedDict()  # reused, not on disk yet
        self._due_host: OrderedDict[bytes, None] = OrderedDict()  # cached, not in host yet
        self._to_disk: OrderedDict[bytes, None] = OrderedDict()  # written or queued there
        self._queue: queue.Queue[tuple[BlockRecord, bool, bool] | None] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.demoted = 0  # blocks queued for the tiers
        self.skipped = 0  # blocks not demoted: the writer was too far behind
        self._writer = threading.Thread(target=self._write_loop, name="kv-tiers", daemon=True)
        self._writer.start()

    @property
    def keep(self) -> Callable[[bytes], bool] | None:
        return self.tiers[0].keep if self.tiers else None

    @keep.setter
    def keep(self, keep: Callable[[bytes], bool] | None) -> None:
        """A session's blocks (the cache's ``is_preferred``): each tier deletes them last."""
        for tier in self.tiers:
            tier.keep = keep

    @property
    def tiers(self) -> list[FileTier]:
        return [tier for tier in (self.host, self.disk) if tier is not None]

    def stats(self) -> list[TierStats]:
        return [tier.stats for tier in self.tiers]

    # ---- demotion (engine thread, then the writer) -------------------------------------------

    def demote(self, evicted: Sequence[EvictedBlock]) -> list[str | None]:
        """Queue the blocks being evicted: their pages are copied now (before anything
        overwrites them) and written by the writer thread. Returns the tier each is kept in
        (``host`` before ``disk``; None: in none), for the cache's events."""
        return self._queue_blocks(evicted, host=self.host is not None, disk=None)

    def checkpoint(self, cached: Sequence[EvictedBlock], to_host: bool, to_disk: bool) -> None:
        """Queue cached blocks (still in the cache) for the node-shared tier and/or the disk
        tier: what an idle worker writes so that a restarted worker finds them
        (:meth:`LLMEngine.checkpoint_tiers`)."""
        self._queue_blocks(cached, host=to_host and self.host is not None,
                           disk=to_disk and self.disk is not None)  # fmt: skip

    def note_cached(self, hashes: Sequence[bytes]) -> None:
        """Blocks the cache registered just now: due in the node-shared tier once idle."""
        if self.host is None:
            return
        with self._lock:
            for block_hash in hashes:
                _remember(self._due_host, block_hash)

    def take_due_host(self, limit: int) -> list[bytes]:
        """Up to ``limit`` of the cached blocks not written to the node-shared tier yet."""
        with self._lock:
            taken = min(limit, len(self._due_host))
            return [self._due_host.popitem(last=False)[0] for _ in range(taken)]

    def note_hits(self, hashes: Sequence[bytes]) -> None:
        """Blocks a prompt reused (from the cache, or a tier): worth a disk write, now (by
        :meth:`checkpoint`, when the worker is idle) or when they are evicted."""
        with self._lock:
            for block_hash in hashes:
                _remember(self._hit, block_hash)
                if self.disk is not None and block_hash not in self._to_disk:
                    _remember(self._due, block_hash)

    def take_due(self, limit: int) -> list[bytes]:
        """Up to ``limit`` of the reused blocks not queued for disk yet, oldest first."""
        with self._lock:
            return [self._due.popitem(last=False)[0] for _ in range(min(limit, len(self._due)))]

    def on_disk(self, block_hash: bytes) -> bool:
        """Whether the block is written to the disk tier, or queued for it."""
        with self._lock:
            if block_hash in self._to_disk:
                return True
        return self.disk is not None and block_hash in self.disk

    def _queue_blocks(
        self, blocks: Sequence[EvictedBlock], host: bool, disk: bool | None
    ) -> list[str | None]:
        """Copy the blocks' pages now and queue them for the tiers named (``disk`` None: a
        demotion, admitted to disk by ``_admit``); the tier each is kept in, or None."""
        if not blocks or not (host or disk is not False):
            return [None] * len(blocks)
        raw = self._export([block_id for block_id, *_ in blocks]).view(torch.uint8)
        kept: list[str | None] = []
        for index, (_, block_hash, parent, tokens) in enumerate(blocks):
            payload = byte_view(raw[:, :, index].contiguous())
            with self._lock:
                demotion = disk is None
                admitted = self._admit(block_hash) if disk is None else disk
                to_disk = self.disk is not None and admitted
                if not (host or to_disk):
                    kept.append(None)
                    continue
                if self._pending_bytes + len(payload) > self.settings.max_pending_bytes:
                    self.skipped += 1
                    kept.append(None)
                    continue
                self._pending_bytes += len(payload)
                self.demoted += demotion
                if to_disk:
                    _remember(self._to_disk, block_hash)
                self._due_host.pop(block_hash, None)
            kept.append("host" if host else "disk")
            self._queue.put((BlockRecord(block_hash, parent, tokens, payload), host, to_disk))
        return kept

    def _admit(self, block_hash: bytes) -> bool:
        """Whether this demotion goes to disk too (under the lock)."""
        count = self._demotions.pop(block_hash, 0) + 1
        self._demotions[block_hash] = count
        while len(self._demotions) > MAX_REMEMBERED:
            self._demotions.popitem(last=False)
        return count >= self.settings.disk_admit_after or block_hash in self._hit

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                record, to_host, to_disk = item
                if to_host and self.host is not None and not self.host.store(record):
                    self._dropped(record.block_hash, self.host)
                if to_disk and self.disk is not None and not self.disk.store(record):
                    with self._lock:
                        self._to_disk.pop(record.block_hash, None)
                    self._dropped(record.block_hash, self.disk)
                with self._lock:
                    self._pending_bytes -= len(record.payload)
            finally:
                self._queue.task_done()

    def _dropped(self, block_hash: bytes, tier: FileTier) -> None:
        """A tier lost the block (a failed write, a file deleted for room): where it is left,
        if anywhere, goes to the cache's events (a demotion to the disk tier if it holds it)."""
        if self.events is None:
            return
        if tier is self.host and self.disk is not None and block_hash in self.disk:
            self.events.record(tier_kind(DEMOTED, "disk"), block_hash)
        else:
            self.events.record(tier_kind(DROPPED, tier.name), block_hash)

    def held(self, limit: int = MAX_SNAPSHOT) -> tuple[tuple[bytes, str], ...]:
        """The blocks the tiers hold, each with its fastest tier (at most ``limit``, the most
        recently used first), for a snapshot of the cache."""
        found: dict[bytes, str] = {}
        for tier in self.tiers:
            for block_hash in tier.hashes(limit):
                found.setdefault(block_hash, tier.name)
        return tuple(itertools.islice(found.items(), limit))

    def flush(self) -> None:
        """Until every queued demotion is written."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=30)
        self._loaders.shutdown(wait=True)

    # ---- promotion (engine thread) -----------------------------------------------------------

    def find(
        self, hashes: Sequence[bytes], token_ids: Sequence[int], start: int, stop: int,
        root: bytes, block_size: int, keep: bool = False,
    ) -> FoundBlocks | None:  # fmt: skip
        """The blocks ``start``, ``start + 1``, ... (before ``stop``) of a prompt a tier holds,
        up to the first it does not, each checked whole and against its parent and tokens; their
        pages read straight into one tensor: the tiers' staging buffer, valid until the next
        call, unless ``keep`` (then a tensor of their own). The first block is read alone (most
        lookups miss there); the rest ``LOAD_THREADS`` at a time, ``LOAD_CHUNK`` per round."""
        stop = min(stop, len(hashes))
        if stop <= start or not self.tiers:
            return None
        buffer = self._staging_for(stop - start, keep)

        def read(index: int) -> tuple[FileTier, float] | None:
            parent = hashes[index - 1] if index else root
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            slot = byte_view(buffer[index - start])
            for tier in self.tiers:
                began = time.perf_counter()
                if tier.read_into(hashes[index], parent, tokens, _exactly(slot)):
                    return tier, time.perf_counter() - began
            return None

        served: list[tuple[FileTier, float]] = []
        first = read(start)
        if first is not None:
            served.append(first)
            index = start + 1
            while index < stop and len(served) == index - start:
                chunk = range(index, min(index + LOAD_CHUNK, stop))
                # every read of the chunk finishes before the run is cut at its first miss: a
                # read still running would write into the staging buffer's next use
                results = [future.result() for future in
                           [self._loaders.submit(read, i) for i in chunk]]  # fmt: skip
                for result in results:
                    if result is None:
                        break
                    served.append(result)
                index = chunk.stop
        if not served:
            return None
        count = len(served)
        for offset, (tier, seconds) in enumerate(served):
            tier.served(hashes[start + offset], seconds)
        self.note_hits(hashes[start : start + count])
        parents = [hashes[i - 1] if i else root for i in range(start, start + count)]
        tokens = [
            tuple(token_ids[i * block_size : (i + 1) * block_size])
            for i in range(start, start + count)
        ]
        pages = buffer[:count].view(self._dtype).view(count, *self._unit_shape)
        return FoundBlocks(list(hashes[start : start + count]), parents, tokens,
                           pages.permute(1, 2, 0, 3, 4, 5))  # fmt: skip

    def _staging_for(self, count: int, keep: bool) -> torch.Tensor:
        """Room for ``count`` blocks' pages: the staging buffer, reused (its pages already
        mapped: a fresh buffer's first touch costs as much as reading the files into it), unless
        ``keep`` or past ``STAGING_BYTES``."""
        needed = count * self._block_bytes
        if keep or needed > STAGING_BYTES:
            return torch.empty((count, self._block_bytes), dtype=torch.uint8)
        if self._copied is not None:  # the GPU's copy out of it must be over before we write
            self._copied.synchronize()
            self._copied = None
        if self._staging is None or self._staging.numel() < needed:
            # pinned under a GPU cache: the copy into it is a DMA, not a staged pageable copy
            self._staging = torch.empty(needed, dtype=torch.uint8, pin_memory=self.pinned)
        return self._staging[:needed].view(count, self._block_bytes)

    def load_into(self, block_ids: list[int], found: FoundBlocks) -> None:
        """Write the blocks' pages into the cache's blocks ``block_ids`` (same order)."""
        self._load(block_ids, found.pages)
        if self.pinned:  # asynchronous from pinned memory: the staging buffer's reuse waits
            self._copied = torch.cuda.Event()
            self._copied.record()


@dataclass(frozen=True)
class FoundBlocks:
    """A run of blocks a tier served: each one's hash, parent hash and tokens, and their pages
    (``[layers, 2, blocks, block_size, kv_heads, head_dim]``, as the cache exports them)."""

    hashes: list[bytes]
    parents: list[bytes]
    tokens: list[tuple[int, ...]]
    pages: torch.Tensor

    def __len__(self) -> int:
        return len(self.hashes)


def _exactly(slot: memoryview) -> Callable[[int], memoryview]:
    """A file's payload goes into ``slot``, which a block's pages fill exactly."""

    def buffer_for(size: int) -> memoryview:
        if size != len(slot):
            raise CorruptBlock(f"payload of {size} bytes, a block's pages are {len(slot)}")
        return slot

    return buffer_for


def _remember(hashes: OrderedDict[bytes, None], block_hash: bytes) -> None:
    """``block_hash`` as the newest of ``hashes``, which keep ``MAX_REMEMBERED`` at most."""
    hashes[block_hash] = None
    hashes.move_to_end(block_hash)
    while len(hashes) > MAX_REMEMBERED:
        hashes.popitem(last=False)
