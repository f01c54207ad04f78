"""Token buckets of generated tokens, one per client key: each holds at most a minute's worth
(``tokens_per_minute``) and refills at that rate. A generation takes its ``max_tokens`` at
admission and gives back what it did not generate when it ends, so a key's rate is bounded by
what its requests may generate, and paid for what they did."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.errors import TooManyRequests

SWEEP_AT = 1024  # buckets held before the full ones (keys idle for a minute) are dropped


@dataclass
class Bucket:
    level: float
    at: float  # when ``level`` was last brought up to date


class TokenBuckets:
    """Every client key's bucket of ``tokens_per_minute`` (0: no bucket, nothing is metered)."""

    def __init__(
        self,
        tokens_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        limit: str = "generate at most {} tokens a minute",
    ) -> None:
        self.capacity, self.clock, self.limit = float(tokens_per_minute), clock, limit
        self.rate = tokens_per_minute / 60.0  # tokens a second
        self.buckets: dict[str, Bucket] = {}
        self.sweep_at = SWEEP_AT

    def take(self, key: str, tokens: int) -> None:
        """Take ``tokens`` from ``key``'s bucket, or raise :class:`TooManyRequests` with the
        seconds until it holds them. A request of more than a minute's worth needs a full
        bucket, and leaves it in debt."""
        if not self.capacity:
            return
        bucket = self._bucket(key)
        needed = min(float(tokens), self.capacity)
        if bucket.level < needed:
            wait_s = math.ceil((needed - bucket.level) / self.rate)
            message = "this key may " + self.limit.format(int(self.capacity))
            raise TooManyRequests(message, retry_after_s=max(1, wait_s))
        bucket.level -= tokens

    def give_back(self, key: str, tokens: int) -> None:
        """Return ``tokens`` taken but not generated."""
        bucket = self.buckets.get(key)
        if bucket is not None and tokens > 0:
            bucket.level = min(self.capacity, bucket.level + tokens)

    def _bucket(self, key: str) -> Bucket:
        now = self.clock()
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.sweep_at:
                self._sweep(now)
            bucket = self.buckets[key] = Bucket(self.capacity, now)
        bucket.level = min(self.capacity, bucket.level + (now - bucket.at) * self.rate)
        bucket.at = now
        return bucket

    def _sweep(self, now: float) -> None:
        """Drop the buckets that have refilled (a new one starts full: nothing is lost)."""
        self.buckets = {
            key: bucket
            for key, bucket in self.buckets.items()
            if bucket.level + (now - bucket.at) * self.rate < self.capacity
        }
        self.sweep_at = max(SWEEP_AT, 2 * len(self.buckets))
