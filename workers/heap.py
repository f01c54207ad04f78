"""The C heap of a worker process (glibc's malloc): how many of its bytes are in use, how many it
holds free, and handing the free pages back to the system now and then.

A worker allocates and frees buffers of changing sizes on several threads every step (tensors
shaped by the batch, hand-off pages, token-channel frames, pickled replies). glibc keeps freed
chunks in per-thread arenas for reuse and, unprompted, returns memory only from the top of the
main arena; so a worker's RSS can creep while the bytes it uses do not. The figures tell the two
apart: ``in_use`` flat and ``free`` growing is the allocator holding pages, ``in_use`` growing is
a leak. Every ``TRIM_PERIOD_S`` the worker calls ``malloc_trim(0)``, which returns every whole
free page of every arena (``madvise``), so that RSS follows what is in use.

Elsewhere than glibc (musl, macOS) there are no figures and nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
TRIM_PERIOD_S = 60.0
FIGURES_PERIOD_S = 5.0  # mallinfo2 walks every arena's free lists: not on every load poll


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@dataclass(frozen=True)
class HeapFigures:
    in_use_bytes: int = 0  # allocated chunks, in arenas and mapped alone
    free_bytes: int = 0  # free chunks the arenas hold (resident until trimmed)
    trims: int = 0  # malloc_trim calls so far
    last_trim_ms: float = 0.0  # how long the latest one took


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):  # not glibc, or one older than 2.33
        return None


class HeapKeeper:
    """Called by the worker's housekeeping (``tick``): refreshes the figures every
    ``FIGURES_PERIOD_S`` and trims every ``trim_period_s`` (0: never)."""

    def __init__(self, trim_period_s: float = TRIM_PERIOD_S, now: float | None = None) -> None:
        """``now``: the clock's reading at start (``time.monotonic()``'s by default)."""
        self._libc = _libc()
        self.trim_period_s = trim_period_s
        self.figures = HeapFigures()
        now = time.monotonic() if now is None else now
        self._next_figures = now
        self._next_trim = now + trim_period_s

    @property
    def available(self) -> bool:
        return self._libc is not None

    def tick(self, now: float | None = None) -> None:
        if self._libc is None:
            return
        now = time.monotonic() if now is None else now
        trims, last_trim_ms = self.figures.trims, self.figures.last_trim_ms
        if self.trim_period_s > 0 and now >= self._next_trim:
            self._next_trim = now + self.trim_period_s
            started = time.perf_counter()
            self._libc.malloc_trim(0)
            trims, last_trim_ms = trims + 1, (time.perf_counter() - started) * 1e3
            self._next_figures = now  # the figures after the trim
        if now >= self._next_figures:
            self._next_figures = now + FIGURES_PERIOD_S
            info = self._libc.mallinfo2()
            in_use = int(info.uordblks) + int(info.hblkhd)
            self.figures = HeapFigures(in_use, int(info.fordblks), trims, round(last_trim_ms, 3))
