"""A size-capped store of KV block files in one directory: the node-shared tier (a folder of
shared memory, ``/dev/shm``, which every worker on the node reads and writes) and the disk tier
(a configured folder, which outlives the worker) are both one of these.

The directory is ``<root>/<layout>``: a folder per KV layout (model fingerprint, dtype, block
size, shape: :func:`layout_folder`), so blocks of another model or layout are never even looked
at. Files are named by block hash (``engine.kv_tiers.block_file``). The tier keeps an index of
the files it knows, least recently used first, rebuilt from the folder at start (so a restarted
worker finds what it wrote before) and refreshed from it every ``RESCAN_EVERY`` stores (so it
finds what other workers wrote, and counts their bytes against the cap); a file another worker
wrote that the index has not seen yet is still found by its name. Past ``capacity_bytes`` the
least recently used files are deleted, a session's (``keep``) after the others. A root another
user could write to is refused: a block planted there would be served as KV.

Every method may run on any thread (the engine's, or the demotion writer's): one lock guards
the index; file reads and writes run outside it.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.kv_tiers.block_file import (
    BlockRecord,
    CorruptBlock,
    header_of,
    read_block,
    write_atomic,
)

RESCAN_EVERY = 64  # stores between two reads of the folder
KEEP_SCAN = 1024  # files looked at for one not kept for a session, at most
SUFFIX = ".kvb"


@dataclass
class TierStats:
    """What a tier did, since its start."""

    name: str
    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0  # blocks loaded and served
    stored: int = 0  # blocks written
    evicted: int = 0  # files deleted for room
    corrupt: int = 0  # files refused by their checks (deleted; the block is computed)
    failed_writes: int = 0  # writes that failed (disk full, I/O error): skipped
    load_seconds: float = 0.0  # reading and checking the blocks served


def layout_folder(layout_key: str) -> str:
    return hashlib.blake2b(layout_key.encode(), digest_size=8).hexdigest()


def private_root(root: Path) -> Path:
    """``root``, made (mode 0700) if missing; :class:`ConfigError` if another user owns it or
    could write to it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.stat()
    if info.st_uid != os.geteuid():
        raise ConfigError(f"KV tier folder {root} belongs to uid {info.st_uid}, not this user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"KV tier folder {root} is writable by other users (mode {info.st_mode & 0o777:o}); "
            "a block planted there would be served: use a folder only this user can write"
        )
    return root


class FileTier:
    def __init__(self, name: str, root: Path, capacity_bytes: int, layout_key: str) -> None:
        self.name = name
        self.layout_key = layout_key
        self.capacity_bytes = capacity_bytes
        self.directory = private_root(Path(root)) / layout_folder(layout_key)
        self.directory.mkdir(mode=0o700, exist_ok=True)
        (self.directory / "LAYOUT").write_text(layout_key + "\n")
        self.stats = TierStats(name, capacity_bytes=capacity_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> bytes, oldest first
        self._stores = 0
        self.on_drop: Callable[[bytes], None] | None = None  # told each file deleted for room
        self.keep: Callable[[bytes], bool] | None = None  # a session's block: deleted last
        self._rescan()

    def hashes(self, limit: int) -> list[bytes]:
        """Up to ``limit`` of the blocks indexed, the most recently used first."""
        with self._lock:
            return list(itertools.islice(reversed(self._index), limit))

    def path_of(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash in self._index:
                return True
        return self.path_of(block_hash).exists()  # another worker's, not indexed yet

    def load(self, block_hash: bytes, parent: bytes, tokens: tuple[int, ...]) -> BlockRecord | None:
        """The block, checked whole and against the ``parent`` and ``tokens`` asked for, and
        counted as served; None if missing, of another prefix (a hash collision), or corrupt
        (then deleted)."""
        start = time.perf_counter()
        buffers: list[memoryview] = []

        def buffer_for(size: int) -> memoryview:
            buffers.append(memoryview(bytearray(size)))
            return buffers[-1]

        if not self.read_into(block_hash, parent, tokens, buffer_for):
            return None
        self.served(block_hash, time.perf_counter() - start)
        return BlockRecord(block_hash, parent, tokens, bytes(buffers[0]))

    def read_into(
        self,
        block_hash: bytes,
        parent: bytes,
        tokens: tuple[int, ...],
        buffer_for: Callable[[int], memoryview],
    ) -> bool:
        """Read the block's payload into ``buffer_for(size)``, checked whole and against the
        ``parent`` and ``tokens`` asked for; False if missing, of another prefix (a hash
        collision), or corrupt (then deleted). Nothing is counted: :meth:`served` does."""
        path = self.path_of(block_hash)
        try:
            with open(path, "rb", buffering=0) as file:
                found_parent, found_tokens, _ = read_block(
                    file, self.layout_key, block_hash, buffer_for
                )
        except FileNotFoundError:
            self._forget(block_hash)
            return False
        except (CorruptBlock, OSError):
            self._drop(block_hash, path, corrupt=True)
            return False
        return (found_parent, found_tokens) == (parent, tokens)

    def served(self, block_hash: bytes, seconds: float) -> None:
        """Count a block read by :meth:`read_into` as served (in ``seconds``): a hit, and the
        most recently used file, for every worker sharing the folder."""
        path = self.path_of(block_hash)
        with self._lock:
            self.stats.hits += 1
            self.stats.load_seconds += seconds
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                size = None
            else:
                size = -1
        try:
            if size is not None:
                size = path.stat().st_size
                with self._lock:
                    self._add(block_hash, size)
            os.utime(path)
        except OSError:
            pass  # deleted meanwhile (for room): it was served all the same

    def store(self, record: BlockRecord) -> bool:
        """Write the block (unless there already); False if the write failed."""
        path = self.path_of(record.block_hash)
        if record.block_hash in self:
            with self._lock:
                if record.block_hash in self._index:
                    self._index.move_to_end(record.block_hash)
            return True
        header = header_of(record, self.layout_key)
        try:
            write_atomic(path, header, record.payload)
        except OSError:
            with self._lock:
                self.stats.failed_writes += 1
            return False
        with self._lock:
            self._add(record.block_hash, len(header) + len(record.payload))
            self.stats.stored += 1
            self._stores += 1
            rescan = self._stores % RESCAN_EVERY == 0
        if rescan:
            self._rescan()
        self._evict_to_fit()
        return True

    def _add(self, block_hash: bytes, size: int) -> None:
        if block_hash not in self._index:
            self.stats.bytes += size
            self.stats.blocks += 1
        self._index[block_hash] = size
        self._index.move_to_end(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.blocks -= 1

    def _drop(self, block_hash: bytes, path: Path, corrupt: bool = False) -> None:
        path.unlink(missing_ok=True)
        self._forget(block_hash)
        if corrupt:
            with self._lock:
                self.stats.corrupt += 1

    def _evict_to_fit(self) -> None:
        while True:
            with self._lock:
                if self.stats.bytes <= self.capacity_bytes or not self._index:
                    return
                block_hash = self._victim()
                self.stats.evicted += 1
            self._drop(block_hash, self.path_of(block_hash))
            if self.on_drop is not None:
                self.on_drop(block_hash)

    def _victim(self) -> bytes:
        """The least recently used file not kept for a session (among the oldest
        ``KEEP_SCAN``; the oldest of all when every one of them is kept). Under the lock."""
        oldest = next(iter(self._index))
        if self.keep is None:
            return oldest
        for block_hash in itertools.islice(self._index, KEEP_SCAN):
            if not self.keep(block_hash):
                return block_hash
        return oldest

    def _rescan(self) -> None:
        """The index from the folder: every block file, oldest use first (by mtime)."""
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    block_hash = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    info = entry.stat()
                except (ValueError, OSError):
                    continue  # a stray name, or a file deleted meanwhile
                found.append((info.st_mtime, block_hash, info.st_size))
        found.sort()
        with self._lock:
            self._index = OrderedDict((h, size) for _, h, size in found)
            self.stats.blocks = len(self._index)
            self.stats.bytes = sum(self._index.values())
        self._evict_to_fit()
