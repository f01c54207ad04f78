"""The prefix cache's changes as a numbered event stream, for routers to mirror it.

The block manager records each block hash it caches (``stored``) and each one it evicts
(``removed``); with KV tiers (``engine/kv_tiers``), an evicted block kept in a tier is
``demoted:<tier>`` instead (a demotion is never a removal: the block is still the worker's to
serve, at its tier's cost), and one the tiers lose (a write skipped or failed, a file deleted for
room) is ``dropped:<tier>``; a block loaded back from a tier is ``stored`` again. Every event gets
the next sequence number of this log. A reader asks for the events
after the last number it has seen (:meth:`KvEventLog.since`); the log keeps the latest
``capacity`` events for that (the replay buffer), so a reader that fell further behind, or one
starting fresh, is told to resynchronise from a snapshot of the cached hashes instead
(``KvEventBatch.gap``). The log's *epoch* is new for every engine, so a router that sees another
epoch knows the worker restarted and its earlier events mean nothing.

Events are appended on the engine thread and read from others: one lock guards the buffer.
A reader may also wait for the next events (:meth:`KvEventLog.wait_since`, a long poll), so a
router learns of a stored block within a few milliseconds instead of at its next load poll.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"
DEMOTED, DROPPED = "demoted", "dropped"  # with a tier: "demoted:host", "dropped:disk"
DEFAULT_CAPACITY = 16384  # events kept for replay (a block hash is 16 bytes)
MAX_BATCH = 8192  # events handed out per read


@dataclass(frozen=True)
class KvEventBatch:
    """A reader's share of a worker's events: ``events`` are ``(seq, kind, hash)`` after the
    number it asked from, up to ``last_seq``. ``gap``: the ones it needs are gone from the replay
    buffer (or it asked from -1, or named another epoch): it must load a snapshot."""

    epoch: str
    root: bytes  # the hash chain's root of this engine (no tenant)
    last_seq: int
    events: tuple[tuple[int, str, bytes], ...] = ()
    gap: bool = False


@dataclass(frozen=True)
class KvSnapshot:
    """Every hash cached as of event ``seq`` (later events apply on top), and the blocks the
    worker's KV tiers hold, each with its tier."""

    epoch: str
    root: bytes
    seq: int
    hashes: tuple[bytes, ...]
    tiered: tuple[tuple[bytes, str], ...] = ()


def tier_kind(kind: str, tier: str) -> str:
    """The event kind of ``kind`` (``DEMOTED`` or ``DROPPED``) for ``tier``."""
    return f"{kind}:{tier}"


def split_kind(kind: str) -> tuple[str, str]:
    """``(kind, tier)`` of an event's kind (tier "" for the cache's own events)."""
    base, _, tier = kind.partition(":")
    return base, tier


class KvEventLog:
    def __init__(self, root: bytes = b"", capacity: int = DEFAULT_CAPACITY) -> None:
        self.root = root
        self.epoch = uuid.uuid4().hex[:16]
        self._events: deque[tuple[int, str, bytes]] = deque(maxlen=capacity)
        self._seq = 0  # the number of the latest event (0: none yet)
        self._lock = threading.Lock()
        self._recorded = threading.Condition(self._lock)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq

    def record(self, kind: str, block_hash: bytes) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, kind, block_hash))
            self._recorded.notify_all()

    def since(self, epoch: str, seq: int) -> KvEventBatch:
        """The events after ``seq`` of ``epoch`` (at most ``MAX_BATCH``: the reader asks again
        from the last one), or a gap."""
        with self._lock:
            last = self._seq
            oldest = self._events[0][0] if self._events else last + 1
            if epoch != self.epoch or seq < 0 or seq > last or seq + 1 < oldest:
                return KvEventBatch(self.epoch, self.root, last, gap=True)
            start = len(self._events) - (last - seq)
            events = tuple(itertools.islice(self._events, start, start + MAX_BATCH))
        end = events[-1][0] if events else seq
        return KvEventBatch(self.epoch, self.root, end, events)

    def wait_since(self, epoch: str, seq: int, timeout_s: float) -> KvEventBatch:
        """:meth:`since`, once there is an event after ``seq`` (or it names another epoch, or
        ``timeout_s`` passed: then maybe no events)."""
        with self._recorded:
            self._recorded.wait_for(
                lambda: epoch != self.epoch or self._seq > seq, timeout=max(0.0, timeout_s)
            )
        return self.since(epoch, seq)

    def snapshot(
        self, hashes: list[bytes], tiered: tuple[tuple[bytes, str], ...] = ()
    ) -> KvSnapshot:
        """A snapshot of ``hashes`` (every cached one, read on the engine thread, where the
        cache's events are recorded: so they are exactly the state as of the latest event) and
        ``tiered`` (the tiers' blocks: their writer's events may already be in it)."""
        return KvSnapshot(self.epoch, self.root, self.last_seq, tuple(hashes), tiered)
