"""A Prometheus counter fed with figures each worker counts itself."""

from __future__ import annotations

from prometheus_client import Counter


class PolledCounter:
    """A counter per worker fed with a figure the worker counts up itself: each figure seen adds
    what it gained over the one seen before. A worker with a new pid restarted and counts from zero,
    so its whole figure is added; a lower figure from the same process (a load answered with the
    stats of an earlier engine step) adds nothing until the figure passes the last one again."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last: dict[tuple[str, ...], tuple[int, float]] = {}  # labels -> (pid, figure)

    def observe(self, labels: tuple[str, ...], pid: int, figure: float) -> None:
        last_pid, last = self._last.get(labels, (pid, 0))
        base = last if pid == last_pid else 0
        self.counter.labels(*labels).inc(max(figure - base, 0))
        self._last[labels] = (pid, max(figure, base))
