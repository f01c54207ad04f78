"""Idle cores lent between the workers of one host (``backend_config.share_idle_cores``).

Each worker of a ``pd_separate`` cluster owns the cores Ray gave it (``num_cpus``; pinned to them
on a one-node Ray). While a worker has nothing to run, the co-located workers of the other role
run extra torch threads on its cores. :class:`CoreLending`, one per worker, owned by its runtime
and driven by the engine loop's ``before_step`` hook, does both halves:

- as a *lender* it keeps a two-byte file under ``/dev/shm``, named by the cluster, role and
  instance: ``[state, threads]``, ``state`` BUSY or IDLE, rewritten only when it changes;
- as a *borrower* it reads its lenders' files before each step and runs its own threads plus
  those of every lender it sees IDLE (``torch.set_num_threads`` on the engine thread, whose pool
  is wide enough: the cluster pins a borrower to its own cores and its lenders').

A lending, as its borrower sees it:

    ========  =========================================  ============  ======================
    state     when                                       threads lent  leaves for
    ========  =========================================  ============  ======================
    MISSING   no file yet (looked for every second)      0             BUSY, IDLE
    BUSY      the file says BUSY                         0             IDLE
    IDLE      the file says IDLE                         its threads   BUSY, HELD
    HELD      the borrower just handed a request off to  0             BUSY (seen), IDLE
              it, and has not seen it busy since                       (``HANDOFF_HOLD_S``)
    ========  =========================================  ============  ======================

HELD exists because a decode worker that was just sent a request is about to be busy, before its
file can say so. Giving a core back is quick: the prefill worker's engine thread (and the pool it
starts) runs at a lower OS priority (``BORROWER_NICE``), so a decode thread that wakes up on its
core takes it at once, and the borrower drops to its own threads at its next step; a decode
worker borrowing an idle prefill worker's cores gives them back within one decode step.

A lender on another host has no file here: nothing is borrowed from it, so one configuration
means the same on one machine and across a KubeRay cluster.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
BORROWER_NICE = 10  # the prefill worker's engine thread: the decode thread wins a shared core
RECHECK_MISSING_S = 1.0  # how often a borrower looks again for a lender's file not there yet
HANDOFF_HOLD_S = 0.5  # a lending handed a request counts as busy until seen busy, or this long
BUSY, IDLE = 0, 1  # the file's state byte


class Lending(enum.IntEnum):
    MISSING = 0
    BUSY = 1
    IDLE = 2
    HELD = 3


def lending_path(cluster_id: str, role: str, instance: int) -> str:
    return str(SHM_DIR / f"pdserve-{cluster_id}-{role}-{instance}.cores")


def remove_lendings(cluster_id: str) -> None:
    """Remove the files of cluster ``cluster_id`` on this host (its workers were killed)."""
    for path in SHM_DIR.glob(f"pdserve-{cluster_id}-*.cores"):
        with contextlib.suppress(OSError):
            path.unlink()


@dataclass(frozen=True)
class SharedCores:
    """What the cluster tells a worker: the file it lends by, the files of the workers it
    borrows from, and whether its engine thread yields a shared core (``BORROWER_NICE``)."""

    lend_path: str
    borrow_paths: tuple[str, ...] = ()
    low_priority: bool = False


class _Lender:
    """A file this worker's borrower reads: its state, its threads, ``held_until``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.next_try = 0.0
        self.held_until = 0.0

    def state(self, now: float) -> Lending:
        if self.fd is None and now >= self.next_try:
            self.next_try = now + RECHECK_MISSING_S
            with contextlib.suppress(OSError):
                self.fd = os.open(self.path, os.O_RDONLY)
        raw = _read(self.fd)
        if raw is None:
            return Lending.MISSING
        if raw[0] != IDLE:
            self.held_until = 0.0  # seen busy: the hand-off arrived
            return Lending.BUSY
        return Lending.HELD if now < self.held_until else Lending.IDLE

    def threads(self) -> int:
        raw = _read(self.fd)
        return raw[1] if raw is not None else 0

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class CoreLending:
    def __init__(self, shared: SharedCores, own_threads: int) -> None:
        self.own = min(max(own_threads, 1), 255)
        self.threads = self.own
        self.num_borrowing_steps = 0
        self._path = shared.lend_path
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self._fd, bytes((IDLE, self.own)), 0)
        self._idle = True
        self._lenders = [_Lender(path) for path in shared.borrow_paths]
        self._lower_priority = shared.low_priority

    def before_step(self, busy: bool) -> None:
        """Engine thread, before each step (``busy``) or after an idle wait: publish this
        worker's state, and set the next step's threads."""
        if self._lower_priority:  # before the engine thread starts its thread pool
            _lower_priority()
            self._lower_priority = False
        if busy != (not self._idle):
            os.pwrite(self._fd, bytes((BUSY if busy else IDLE,)), 0)
            self._idle = not busy
        if busy and self._lenders:
            self._set_threads(self.own + self._lent_threads())

    def handed_off(self) -> None:
        """A request was handed off: the decode workers are about to be busy (HELD)."""
        until = time.monotonic() + HANDOFF_HOLD_S
        for lender in self._lenders:
            lender.held_until = until

    def _lent_threads(self) -> int:
        now = time.monotonic()
        lent = [lender for lender in self._lenders if lender.state(now) == Lending.IDLE]
        return sum(lender.threads() for lender in lent)

    def _set_threads(self, threads: int) -> None:
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self.num_borrowing_steps += threads > self.own

    def close(self) -> None:
        for lender in self._lenders:
            lender.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self._path)


def _read(fd: int | None) -> bytes | None:
    """A lending file's two bytes; None if it is not open, cannot be read or is not whole."""
    if fd is None:
        return None
    try:
        raw = os.pread(fd, 2, 0)
    except OSError:
        return None
    return raw if len(raw) == 2 else None


def _lower_priority() -> None:
    """This thread (and the threads it starts later) at ``BORROWER_NICE``."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BORROWER_NICE)
    except OSError as exc:
        log.warning("could not lower the engine thread's priority: %s", exc)
