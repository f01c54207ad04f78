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

A busy decode worker may also *yield* its cores (``decode_yield_ms``): a 1,000-token prompt takes
about 4 s on one CPU core and 2.3 s on two, so a time-to-first-token target can need both even
while streams are running. A prefill worker with at least ``YIELD_MIN_TOKENS`` prompt tokens to
compute says so in its lender's file; the decode worker, between two of its steps, marks itself
yielding and pauses (up to ``decode_yield_ms``) until the prefill worker has run one step on both
workers' threads, a step sized to fit that pause. The streams pay one long gap per such step;
prompt chunks small enough to keep gaps short would not pay: on two threads a 1,000-token prompt
in 64-token chunks takes longer than in one chunk on one thread.

The file, written only with single-byte writes: ``[state, threads, yield_seq, done_seq,
wants]``; the lender writes the first three (state: busy, idle or yielding; ``yield_seq``
numbers its yields), its borrower the last two (``done_seq``: the last yield it ran a step in;
``wants``: it has a long prompt to compute).
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
YIELD_MIN_TOKENS = 256  # a prefill worker asks for a yield with this many prompt tokens to compute
YIELD_WAIT_S = 0.15  # how long it waits for a busy lender to yield (one decode step)
YIELDED_STEP_FRACTION = 0.8  # a step run in a yield is sized to this share of the pause
UNYIELDED_STEP_S = 0.2  # a step on its own threads while it waits for a yield
POLL_S = 0.001
BUSY, IDLE, YIELDING = 0, 1, 2  # a lender's state
STATE, THREADS, YIELD_SEQ, DONE_SEQ, WANTS = range(5)  # the file's bytes
FILE_SIZE = 5


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
    engine thread runs at ``BORROWER_NICE``; ``yield_ms`` (``decode_yield_ms``): the longest
    this lender pauses for its borrower (0: never); ``asked_yield_ms``: this borrower asks busy
    lenders for pauses that long while a long prompt waits (0: never)."""

    lend_path: str | None = None
    borrow_paths: tuple[str, ...] = ()
    low_priority: bool = False
    yield_ms: int = 0
    asked_yield_ms: int = 0


class Lender:
    """The file saying whether this worker is idle, and how many threads it lends then."""

    def __init__(self, path: str, threads: int) -> None:
        self.path = path
        self._threads = min(max(threads, 1), 255)
        self._idle: bool | None = True
        self._seq = 0
        self.num_yields = 0
        self.yielded_s = 0.0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self._fd, bytes((IDLE, self._threads, 0, 0, 0)), 0)

    def set_idle(self, idle: bool) -> None:
        if idle != self._idle:
            os.pwrite(self._fd, bytes((IDLE if idle else BUSY,)), STATE)
            self._idle = idle

    def yield_if_wanted(self, max_s: float) -> float:
        """Engine thread of a busy lender, between two steps: if the borrower wants a yield,
        pause until it ran one step on these cores too, or ``max_s``; the seconds paused."""
        state = self._read()
        if max_s <= 0 or state is None or not state[WANTS]:
            return 0.0
        self._seq = self._seq % 255 + 1
        if self._seq == state[DONE_SEQ]:
            self._seq = self._seq % 255 + 1
        os.pwrite(self._fd, bytes((self._seq,)), YIELD_SEQ)
        os.pwrite(self._fd, bytes((YIELDING,)), STATE)
        start = time.monotonic()
        deadline = start + max_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            state = self._read()
            if state is None or state[DONE_SEQ] == self._seq or not state[WANTS]:
                break
        os.pwrite(self._fd, bytes((BUSY,)), STATE)
        self._idle = False
        paused = time.monotonic() - start
        self.num_yields += 1
        self.yielded_s += paused
        return paused

    def _read(self) -> bytes | None:
        try:
            state = os.pread(self._fd, FILE_SIZE, 0)
        except OSError:
            return None
        return state if len(state) == FILE_SIZE else None

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
    wants: bool = False  # as last written to the file
    running_yield: int = 0  # the yield this step runs in (0: none)

    def read(self, now: float) -> bytes | None:
        if self.fd is None:
            if now < self.next_try:
                return None
            self.next_try = now + RECHECK_MISSING_S
            try:
                self.fd = os.open(self.path, os.O_RDWR)
            except OSError:
                return None
        try:
            state = os.pread(self.fd, FILE_SIZE, 0)
        except OSError:
            return None
        return state if len(state) == FILE_SIZE else None

    def write(self, offset: int, value: int) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.pwrite(self.fd, bytes((value,)), offset)

    def lent_threads(self, now: float) -> int:
        """Threads lent for the next step: all of an idle lender's, or of one yielding to us."""
        state = self.read(now)
        if state is None:
            return 0
        if state[STATE] == YIELDING and state[YIELD_SEQ] != state[DONE_SEQ]:
            self.running_yield = state[YIELD_SEQ]
            return state[THREADS]
        if state[STATE] != IDLE:
            self.seen_busy = True
            return 0
        if now < self.held_until and not self.seen_busy:
            return 0
        return state[THREADS]

    def step_done(self) -> None:
        if self.running_yield:
            self.write(DONE_SEQ, self.running_yield)
            self.running_yield = 0

    def set_wants(self, wants: bool, now: float) -> None:
        if self.fd is None:
            self.read(now)  # opens the file, if it is there yet
        if wants != self.wants and self.fd is not None:
            self.write(WANTS, int(wants))
            self.wants = wants

    def is_busy(self, now: float) -> bool:
        state = self.read(now)
        return state is not None and state[STATE] == BUSY


@dataclass
class Borrower:
    """The threads to run this step: ``own`` plus those of every idle lender, and of every
    lender yielding to a step of ours."""

    own: int
    paths: tuple[str, ...]
    _lendings: list[_Lending] = field(init=False)
    threads: int = field(init=False)
    num_borrowing_steps: int = 0
    num_yielded_steps: int = 0

    def __post_init__(self) -> None:
        self._lendings = [_Lending(path) for path in self.paths]
        self.threads = self.own

    def update(self, wants_yield: bool = False) -> int:
        """Engine thread, before a step: set torch's thread count; returns it. ``wants_yield``:
        ask busy lenders to yield (a long prompt waits), and wait a little for one to."""
        self.step_done()
        now = time.monotonic()
        for lending in self._lendings:
            lending.set_wants(wants_yield, now)
        if wants_yield:
            self._wait_for_a_yield(now)
            now = time.monotonic()
        threads = self.own + sum(lending.lent_threads(now) for lending in self._lendings)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        self.num_borrowing_steps += threads > self.own
        self.num_yielded_steps += self.in_a_yield
        return threads

    @property
    def in_a_yield(self) -> bool:
        """This step runs on threads a busy lender yielded."""
        return any(lending.running_yield for lending in self._lendings)

    def _wait_for_a_yield(self, now: float) -> None:
        if not self._lendings:
            return
        deadline = now + YIELD_WAIT_S
        while now < deadline and all(lending.is_busy(now) for lending in self._lendings):
            time.sleep(POLL_S)
            now = time.monotonic()

    def step_done(self) -> None:
        """Engine thread, after a step (or when idle): end the yields it ran in."""
        for lending in self._lendings:
            lending.step_done()

    def idle(self) -> None:
        """Engine thread, when it has no work: end its yields and ask for none."""
        self.step_done()
        now = time.monotonic()
        for lending in self._lendings:
            lending.set_wants(False, now)

    def hold(self) -> None:
        """A request was handed off: its decode worker is about to be busy."""
        until = time.monotonic() + HANDOFF_HOLD_S
        for lending in self._lendings:
            lending.held_until, lending.seen_busy = until, False

    def close(self) -> None:
        self.idle()
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
