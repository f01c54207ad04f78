"""Idle cores lent between the workers of one host (``share_idle_cores``).

Each worker of a ``pd_separate`` cluster owns the cores Ray gave it (``num_cpus``; pinned to them
on a one-node Ray). While a worker has nothing to run, the workers of the other role on the same
host may run extra torch threads on its cores:

- a *lender* publishes, in a small file under ``/dev/shm`` named by the cluster, whether it is
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
to be busy), without waiting for the decode worker's file to say so (``HANDOFF_HOLD_S``, or until
it sees it busy); meanwhile a long prompt's steps on its own threads are short, so a decode
worker idle again by then lends its core at the next one. A decode worker borrowing an idle
prefill worker's core gives it back within one decode step.

A busy decode worker may also *yield* its cores (``decode_yield_ms``): a 1,000-token prompt takes
about 4 s on one CPU core and 2.3 s on two, so a time-to-first-token target can need both even
while streams are running. Prompt chunks small enough to keep every gap short would not pay: on
two threads a 1,000-token prompt in 64-token chunks takes longer than in one chunk on one thread.
So, with ``YIELD_MIN_TOKENS`` prompt tokens or more to compute, a prefill worker asks (``wants``)
and the decode worker, between two of its steps, pauses:

1. the lender numbers a yield (``yield_seq``) and marks itself ``YIELDING``;
2. the borrower, before its next step, claims it (``claim_seq``), reads the state again, and runs
   that step on both workers' threads if it is still ``YIELDING`` (else it releases the yield at
   once by writing ``done_seq``); the step's prompt chunk is sized to ``YIELDED_STEP_FRACTION``
   of the pause granted (at most ``decode_yield_ms``);
3. the borrower writes ``done_seq`` as soon as the step ends; the lender goes on.

The lender gives up a yield nobody claims within the pause granted, or when the borrower stops
asking: it writes ``BUSY`` and then reads the claim, so a claim that came first is waited for.
A claimed yield lasts at most the pause granted from the claim. A yield that went unclaimed
(the borrower died, or is stuck in a long step) makes the lender stop yielding for
``UNCLAIMED_BACKOFF_S``, doubled each time, so a dead borrower costs streams little. One
granted too short for a live borrower to end the step it was in (under ``CLAIMABLE_S``) is no
sign of that: only ``MAX_SHORT_UNCLAIMED`` of those in a row back off (otherwise the borrower
would compute the rest of its prompt on its own threads, in one step, for the whole backoff).

Pauses are bounded (workers/yield_policy.py) over time (``decode_yield_percent``: a
lender earns pause time at that share of the time that passes, up to one ``decode_yield_ms``, and
yields only with the pause earned; a pause spends what it lasted), and per stream
(``decode_yield_tpot_ms``: a pause is only as long as every running stream affords and still
ends within that time per output token). The lender writes the pause it grants (``grant``) with
the yield, and the borrower sizes its step to it.

While it will not yield for a while (backing off, or its pause time spent), a lender says so
(``open`` ``CLOSED``), and its borrower neither waits for a yield nor shortens its steps
meanwhile. A pause its streams cut short (below ``MIN_GRANT_S``: a stream behind its target, a
short prompt of its own) is only put off (``DEFERRED``): the borrower goes on in short steps on
its own threads, without waiting between them, until the lender says ``OPEN_NOW`` again.

The file, written only with single-byte writes: ``[state, threads, yield_seq, done_seq, wants,
claim_seq, open, grant]``; the lender writes ``state``, ``threads``, ``yield_seq``, ``open`` and
``grant``, its borrower ``done_seq``, ``wants`` and ``claim_seq``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.yield_policy import PauseBudget

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
BORROWER_NICE = 10  # the prefill worker's engine thread: the decode thread wins a shared core
RECHECK_MISSING_S = 1.0  # how often a borrower looks again for a lender's file not there yet
HANDOFF_HOLD_S = 0.5  # after a hand-off, lenders count as busy until seen busy, or this long
YIELD_MIN_TOKENS = 256  # a prefill worker asks for yields with this many prompt tokens to compute
YIELD_WAIT_S = 0.15  # how long it waits for a busy lender to yield (one decode step)
YIELDED_STEP_FRACTION = 0.8  # a step run in a yield is sized to this share of decode_yield_ms
UNYIELDED_STEP_S = 0.2  # a step on its own threads while it waits for a yield
UNCLAIMED_BACKOFF_S = 5.0  # no yield for this long after one went unclaimed (then doubled)
CLAIMABLE_S = 2 * UNYIELDED_STEP_S  # a live borrower claims a yield within this
MAX_SHORT_UNCLAIMED = 3  # yields unclaimed within CLAIMABLE_S, in a row, that back off
MAX_BACKOFF_S = 60.0
STEP_SMOOTHING = 0.1  # weight of a lender's newest step in its average
POLL_S = 0.001
BUSY, IDLE, YIELDING = 0, 1, 2  # a lender's state
# the file's bytes
STATE, THREADS, YIELD_SEQ, DONE_SEQ, WANTS, CLAIM_SEQ, OPEN, GRANT = range(8)
CLOSED, OPEN_NOW, DEFERRED = 0, 1, 2  # OPEN: no yield for a while, one at the next step, later
FILE_SIZE = 8
GRANT_UNIT_S = 0.05  # GRANT: the yield's length, in these units (decode_yield_ms <= 10 s fits)
MIN_GRANT_S = 0.25  # a pause its streams cut shorter than this is not worth a yielded step


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
    lenders for pauses that long while a long prompt waits (0: never); ``yield_share``
    (``decode_yield_percent`` / 100): the most of its time this lender spends paused;
    ``yield_tpot_ms`` (``decode_yield_tpot_ms``): each pause no longer than keeps every running
    stream's time per output token within this (0: no target)."""

    lend_path: str | None = None
    borrow_paths: tuple[str, ...] = ()
    low_priority: bool = False
    yield_ms: int = 0
    asked_yield_ms: int = 0
    yield_share: float = 1.0
    yield_tpot_ms: int = 0


class Lender:
    """The file saying whether this worker is idle, and how many threads it lends then."""

    def __init__(self, path: str, threads: int, yield_share: float = 1.0) -> None:
        """``yield_share``: the long-run share of its time it may spend paused for yields."""
        self.path = path
        self._threads = min(max(threads, 1), 255)
        self.pauses = PauseBudget(yield_share)
        self.step_s: float | None = None  # its busy steps (and their overhead), averaged
        self._busy_since: float | None = None  # the end of its last pause or step check
        self._idle: bool | None = True
        self._seq = 0
        self._backoff_s = UNCLAIMED_BACKOFF_S
        self._short_unclaimed = 0  # yields in a row unclaimed within CLAIMABLE_S
        self._no_yield_until = 0.0
        self.num_yields = 0
        self.num_unclaimed = 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._open = OPEN_NOW  # what OPEN says
        self._while_paused: Callable[[], None] | None = None
        os.pwrite(self._fd, bytes((IDLE, self._threads, 0, 0, 0, 0, OPEN_NOW, 0)), 0)

    def set_idle(self, idle: bool) -> None:
        if idle:
            self._busy_since = None  # its next step is not timed from before the idle time
        if idle != self._idle:
            self._write(STATE, IDLE if idle else BUSY)
            self._idle = idle

    def yield_if_wanted(
        self,
        max_s: float,
        headroom: Callable[[float | None], float] | None = None,
        while_paused: Callable[[], None] | None = None,
    ) -> float:
        """Engine thread of a busy lender, between two steps: if the borrower asks, pause while
        it runs one step on these cores too (see the module's steps); the seconds paused.
        ``headroom(step_s)``: the longest pause its streams afford (workers/
        yield_policy.py); the pause is no longer, and none is cut below ``MIN_GRANT_S``.
        ``while_paused``: called at every poll of the pause (the engine thread's queued calls:
        a reservation asked meanwhile is answered at once, not after the pause)."""
        start = time.monotonic()
        if self._busy_since is not None:
            self._stepped(start - self._busy_since)
        self._while_paused = while_paused
        try:
            return self._yield_if_wanted(max_s, start, headroom)
        finally:
            self._while_paused = None
            self._busy_since = time.monotonic()

    def _stepped(self, seconds: float) -> None:
        last = self.step_s
        self.step_s = seconds if last is None else last + STEP_SMOOTHING * (seconds - last)

    def _yield_if_wanted(
        self, max_s: float, start: float, headroom: Callable[[float | None], float] | None
    ) -> float:
        state = self._read()
        if max_s <= 0 or state is None or not state[WANTS]:
            return 0.0
        may, opens, grant_s = False, CLOSED, max_s
        if start >= self._no_yield_until:  # its streams are asked only when a pause may come
            grant_s = max_s if headroom is None else min(max_s, headroom(self.step_s))
            afforded = grant_s >= min(MIN_GRANT_S, max_s)
            may = afforded and self.pauses.allows(grant_s, start, max_s)
            # streams that cut this pause short put it off by a few steps: the borrower keeps
            # its steps short for it, without waiting; backing off or a spent budget close it
            opens = OPEN_NOW if may else CLOSED if afforded else DEFERRED
        if opens != self._open:
            self._write(OPEN, opens)
            self._open = opens
        if not may:
            return 0.0
        max_s = grant_s
        seq = self._seq = _next_seq(self._seq, state[DONE_SEQ], state[CLAIM_SEQ])
        self._write(YIELD_SEQ, seq)
        self._write(GRANT, min(max(int(grant_s / GRANT_UNIT_S + 1e-9), 1), 255))
        self._write(STATE, YIELDING)
        self._idle = None
        state = self._wait(lambda s: s[CLAIM_SEQ] == seq or not s[WANTS], start + max_s)
        claimed = state is not None and state[CLAIM_SEQ] == seq
        if claimed:  # still YIELDING while its step runs: the claim stands
            self._wait(lambda s: s[DONE_SEQ] == seq, time.monotonic() + max_s)
        self._write(STATE, BUSY)
        self._idle = False
        if not claimed:  # withdrawn; a claim that came before that is waited for
            after = self._read()
            claimed = after is not None and after[CLAIM_SEQ] == seq
            if claimed and after is not None and after[DONE_SEQ] != seq:
                self._wait(lambda s: s[DONE_SEQ] == seq, time.monotonic() + max_s)
        self.num_yields += 1
        self._note(claimed, timed_out=state is None, waited_s=max_s)
        paused = time.monotonic() - start
        self.pauses.spend(paused)
        return paused

    def _note(self, claimed: bool, timed_out: bool, waited_s: float) -> None:
        """After a yield: one nobody claimed while asking, in ``waited_s``, backs off further
        yields, unless it was too short to tell (module docstring)."""
        if claimed or not timed_out:  # taken, or no longer asked for: the borrower is alive
            self._backoff_s = UNCLAIMED_BACKOFF_S
            self._short_unclaimed = 0
            return
        self.num_unclaimed += 1
        if waited_s < CLAIMABLE_S and self._short_unclaimed + 1 < MAX_SHORT_UNCLAIMED:
            self._short_unclaimed += 1
            return
        self._short_unclaimed = 0
        self._no_yield_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)

    def _wait(self, done: Callable[[bytes], bool], deadline: float) -> bytes | None:
        """Poll the file until ``done(state)``: that state, or None at ``deadline``."""
        while time.monotonic() < deadline:
            state = self._read()
            if state is not None and done(state):
                return state
            if self._while_paused is not None:
                self._while_paused()
            time.sleep(POLL_S)
        return None

    def _write(self, offset: int, value: int) -> None:
        os.pwrite(self._fd, bytes((value,)), offset)

    def _read(self) -> bytes | None:
        return read_state(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def read_state(fd: int) -> bytes | None:
    """A lending file's bytes; None if it cannot be read or is not whole."""
    try:
        state = os.pread(fd, FILE_SIZE, 0)
    except OSError:
        return None
    return state if len(state) == FILE_SIZE else None


def _next_seq(seq: int, *taken: int) -> int:
    """The next yield number in 1..255, none of ``taken`` (a stale done or claim)."""
    while True:
        seq = seq % 255 + 1
        if seq not in taken:
            return seq


def lower_priority() -> None:
    """This thread (and the threads it starts later) at ``BORROWER_NICE``."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BORROWER_NICE)
    except OSError as exc:
        log.warning("could not lower the engine thread's priority: %s", exc)
