"""Each worker's prefix cache as its own events say it is: what the router weighs first.

Every worker numbers the block hashes its cache stores and evicts (``engine.kv_events``); each
load poll, and each router's long poll of a worker, brings the events after the last one this
index applied (an event that arrives twice applies once), and the index keeps, per
worker, the set of hashes cached there. So every coordinator in front of the same workers holds
the same picture, whoever routed the requests. A worker's first poll, a worker that restarted (a
new *epoch*), and a gap in the numbers (the worker no longer holds the events this index missed)
each make the index load a snapshot of that worker's cache instead (a *resync*); the events that
follow apply on top of it. Until then that worker counts as holding nothing here: a resync can
cost a cache hit, never send a request to a worker for blocks it does not hold.

Hashes are the engines' own (rooted in the model fingerprint each worker reports, and the tenant,
as ``engine.prefix_hash`` roots them), and a worker's set is bounded by the blocks it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_events import REMOVED, STORED, KvEventBatch, KvSnapshot

WorkerKey = tuple[str, int]  # (role, instance)


@dataclass
class WorkerMirror:
    epoch: str = ""
    root: bytes = b""
    seq: int = -1  # the last event applied (-1: waiting for a snapshot)
    hashes: set[bytes] = field(default_factory=set)


class KvIndex:
    def __init__(self) -> None:
        self._workers: dict[WorkerKey, WorkerMirror] = {}
        self.num_events = 0  # events applied
        self.num_resyncs = 0  # snapshots loaded after a gap or a new epoch

    def cursor(self, worker: WorkerKey) -> tuple[str, int]:
        """What to ask ``worker`` for: events after (epoch, seq); seq -1 means none known."""
        mirror = self._workers.get(worker)
        return (mirror.epoch, mirror.seq) if mirror is not None else ("", -1)

    def cursors(self) -> dict[WorkerKey, tuple[str, int]]:
        return {key: (m.epoch, m.seq) for key, m in self._workers.items()}

    def root(self, worker: WorkerKey) -> bytes | None:
        mirror = self._workers.get(worker)
        return mirror.root if mirror is not None and mirror.seq >= 0 else None

    def apply(self, worker: WorkerKey, batch: KvEventBatch, capacity: int = 0) -> bool:
        """Apply a poll's events; True when the worker must be resynchronised from a snapshot
        (a gap, another epoch, a first poll, or more hashes than its ``capacity`` blocks).
        A batch with no epoch is a worker that publishes no events: nothing to do."""
        if not batch.epoch:
            return False
        mirror = self._workers.setdefault(worker, WorkerMirror())
        if batch.gap or batch.epoch != mirror.epoch or mirror.seq < 0:
            self._forget(mirror, batch.epoch, batch.root)
            return True
        for seq, kind, block_hash in batch.events:
            if seq <= mirror.seq:  # applied already (a load poll and a long poll overlap)
                continue
            if seq != mirror.seq + 1:  # never applied out of order
                self._forget(mirror, batch.epoch, batch.root)
                return True
            if kind == STORED:
                mirror.hashes.add(block_hash)
            elif kind == REMOVED:
                mirror.hashes.discard(block_hash)
            mirror.seq = seq
            self.num_events += 1
        if capacity and len(mirror.hashes) > capacity:
            self._forget(mirror, batch.epoch, batch.root)
            return True
        return False

    def load(self, worker: WorkerKey, snapshot: KvSnapshot) -> None:
        """Start ``worker``'s mirror over from ``snapshot`` (its events after it follow)."""
        self._workers[worker] = WorkerMirror(
            snapshot.epoch, snapshot.root, snapshot.seq, set(snapshot.hashes)
        )
        self.num_resyncs += 1

    def match(self, worker: WorkerKey, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` (rooted at the worker's root) it holds."""
        mirror = self._workers.get(worker)
        if mirror is None or mirror.seq < 0:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in mirror.hashes:
                break
            count += 1
        return count

    def num_entries(self, worker: WorkerKey) -> int:
        mirror = self._workers.get(worker)
        return len(mirror.hashes) if mirror is not None else 0

    def drop(self, worker: WorkerKey) -> None:
        self._workers.pop(worker, None)

    @staticmethod
    def _forget(mirror: WorkerMirror, epoch: str, root: bytes) -> None:
        mirror.epoch, mirror.root, mirror.seq = epoch, root, -1
        mirror.hashes.clear()
