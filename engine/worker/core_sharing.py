"""Idle cores lent between the workers of one host (``share_idle_cores``).

Each worker of a ``pd_separate`` cluster owns the cores Ray gave it (``num_cpus``; pinned to them
on a one-node Ray). While a worker has nothing to run, the workers of the other role on the same
host may run extra torch threads on its cores:

- a *lender* publishes, in a two-byte file under ``/dev/shm`` named by the cluster, whether it is
  idle and how many threads it owns; it rewrites the file only when that changes;
- a *borrower* reads its lenders' files before each step and runs its own threads plus those of
  every idle lender (``torch.set_num_threads`` on the engine thread, whose pool is created
  wide enough: the cluster pins a borrower to its own cores and its lenders').

A lender on another host has no file here: nothing is borrowed from it, so one configuration
means the same on a single machine and across a KubeRay cluster (only co-located actors share).

Giving a core back must be quick, and it is: the prefill worker's engine thread (and the pool it
starts) runs at a lower OS priority (``BORROWER_NICE``), so a decode thread that wakes up on its
core takes it at once, and the prefill worker drops to its own threads at its next step. A
prefill worker also stops borrowing as soon as it hands a request off (the decode worker is about
to be busy), without waiting for the decode worker's file to say so. A decode worker borrowing an
idle prefill worker's core gives it back within one decode step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
BORROWER_NICE = 10  # the prefill worker's engine thread: the decode thread wins a shared core
RECHECK_MISSING_S = 1.0  # how often a borrower looks again for a lender's file not there yet
HANDOFF_HOLD_S = 0.5  # after a hand-off, lenders count as busy until seen busy, or this long


def lending_path(cluster_id: str, role: str, instance: int) -> str:
    return str(SHM_DIR / f"pdserve-{cluster_id}-{role}-{instance}.cores")


def remove_lendings(cluster_id: str) -> None:
    """Remove the files of cluster ``cluster_id`` on this host (its workers were killed)."""
    for path in SHM_DIR.glob(f"pdserve-{cluster_id}-*.cores"):
        with contextlib.suppress(OSError):
            path.unlink()


@dataclass(frozen=True)
class CoreSharing:
    """What a worker lends (``lend_path``) and borrows (``borrow_paths``); ``low_priority``: its
    engine thread runs at ``BORROWER_NICE``."""

    lend_path: str | None = None
    borrow_paths: tuple[str, ...] = ()
    low_priority: bool = False


class Lender:
    """The file saying whether this worker is idle, and how many threads it lends then."""

    def __init__(self, path: str, threads: int) -> None:
        self.path = path
        self._threads = min(max(threads, 1), 255)
        self._idle: bool | None = None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.set_idle(True)

    def set_idle(self, idle: bool) -> None:
        if idle != self._idle:
            os.pwrite(self._fd, bytes((int(idle), self._threads)), 0)
            self._idle = idle

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclass
class _Lending:
    path: str
    fd: int | None = None
    next_try: float = 0.0
    held_until: float = 0.0  # counts as busy until then (a hand-off went its way)
    seen_busy: bool = False

    def idle_threads(self, now: float) -> int:
        if self.fd is None:
            if now < self.next_try:
                return 0
            self.next_try = now + RECHECK_MISSING_S
            try:
                self.fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return 0
        try:
            state = os.pread(self.fd, 2, 0)
        except OSError:
            state = b""
        if len(state) != 2:
            return 0
        idle, threads = state
        if not idle:
            self.seen_busy = True
        if now < self.held_until and not self.seen_busy:
            return 0
        return threads if idle else 0


@dataclass
class Borrower:
    """The threads to run this step: ``own`` plus those of every idle lender."""

    own: int
    paths: tuple[str, ...]
    _lendings: list[_Lending] = field(init=False)
    threads: int = field(init=False)
    num_borrowing_steps: int = 0

    def __post_init__(self) -> None:
        self._lendings = [_Lending(path) for path in self.paths]
        self.threads = self.own

    def update(self) -> int:
        """Engine thread, before a step: set torch's thread count; returns it."""
        now = time.monotonic()
        threads = self.own + sum(lending.idle_threads(now) for lending in self._lendings)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self.num_borrowing_steps += threads > self.own
        return threads

    def hold(self) -> None:
        """A request was handed off: its decode worker is about to be busy."""
        until = time.monotonic() + HANDOFF_HOLD_S
        for lending in self._lendings:
            lending.held_until, lending.seen_busy = until, False

    def close(self) -> None:
        for lending in self._lendings:
            if lending.fd is not None:
                with contextlib.suppress(OSError):
                    os.close(lending.fd)
                lending.fd = None


def lower_priority() -> None:
    """This thread (and the threads it starts later) at ``BORROWER_NICE``."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BORROWER_NICE)
    except OSError as exc:
        log.warning("could not lower the engine thread's priority: %s", exc)
