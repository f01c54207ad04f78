"""What one coordinator saw of its requests during the planner's interval: arrivals and their
prompt tokens, finished requests' output tokens, TTFT and mean ITL (``TrafficWindow``), taken
as a :class:`TrafficSample` once an interval. Bounded: at most ``MAX_SAMPLES`` latencies an
interval (the oldest go first), whatever the traffic."""

from __future__ import annotations

import math
import threading
from collections import deque

from coordinator.planner.planner import TrafficSample

MAX_SAMPLES = 4096


class TrafficWindow:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrivals = 0
        self._prompt_tokens = 0
        self._finished = 0
        self._output_tokens = 0
        self._last_output_tokens = 0.0  # a window where nothing finished keeps the last mean
        self._ttfts: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._itls: deque[float] = deque(maxlen=MAX_SAMPLES)

    def arrived(self, prompt_tokens: int) -> None:
        with self._lock:
            self._arrivals += 1
            self._prompt_tokens += prompt_tokens

    def finished(self, output_tokens: int, ttft_s: float | None, itl_s: float | None) -> None:
        with self._lock:
            self._finished += 1
            self._output_tokens += output_tokens
            if ttft_s is not None:
                self._ttfts.append(ttft_s)
            if itl_s is not None:
                self._itls.append(itl_s)

    def take(self, window_s: float, starting: int = 0) -> TrafficSample:
        """The interval's sample; the window starts afresh."""
        with self._lock:
            if self._finished:
                self._last_output_tokens = self._output_tokens / self._finished
            sample = TrafficSample(
                window_s=window_s,
                arrivals=self._arrivals,
                prompt_tokens=self._prompt_tokens / self._arrivals if self._arrivals else 0.0,
                output_tokens=self._last_output_tokens,
                ttft_p90_s=_p90(self._ttfts),
                itl_p90_s=_p90(self._itls),
                starting=starting,
            )
            self._arrivals = self._prompt_tokens = self._finished = self._output_tokens = 0
            self._ttfts.clear()
            self._itls.clear()
        return sample


def _p90(values: deque[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]  # the nearest rank
