"""How long a hand-off waiting for KV blocks on a full decode worker has yet to wait, from the
pace at which the queue's waiters were granted blocks lately.

The queue (``reservations.py``) tells :class:`GrantPace` when it starts and stops holding
waiters and how many blocks each grant took (a grant to a hand-off that fit at once, into an
empty queue, is not counted). The pace is the blocks granted per second of
*waiting time* (seconds in which some hand-off waited; an idle queue's time counts nothing) over
the last ``window_s`` of it, once ``min_grants`` grants were seen there: before that there is no
estimate and nobody is refused early. A waiter whose blocks, and those of every waiter ahead of
it, exceed the free blocks by ``deficit`` blocks may expect to wait ``deficit / pace`` seconds.
The pace falls while no grant comes (the time since the last one counts), so a pool that stopped
draining gives long estimates.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 30.0  # seconds of waiting time the pace is measured over
MIN_GRANTS = 3  # grants within the window before there is an estimate


class GrantPace:
    def __init__(self, window_s: float = WINDOW_S, min_grants: int = MIN_GRANTS) -> None:
        self.window_s = window_s
        self.min_grants = min_grants
        self._waited_s = 0.0  # waiting time up to _since (or up to now, while not waiting)
        self._since: float | None = None  # when the queue last began holding waiters
        self._grants: deque[tuple[float, int]] = deque()  # (waiting time, blocks)

    def _clock(self, now: float) -> float:
        """Seconds of waiting time so far."""
        return self._waited_s + (now - self._since if self._since is not None else 0.0)

    def waiting(self, now: float, held: bool) -> None:
        """The queue holds waiters (``held``) from ``now`` on, or none."""
        if held and self._since is None:
            self._since = now
        elif not held and self._since is not None:
            self._waited_s += now - self._since
            self._since = None

    def granted(self, now: float, blocks: int) -> None:
        """A waiter was granted ``blocks`` blocks at ``now``. One granted while the queue held
        no waiter (it fit at once) says nothing of the pace: it is not counted."""
        if self._since is None:
            return
        clock = self._clock(now)
        self._grants.append((clock, blocks))
        while self._grants and self._grants[0][0] < clock - self.window_s:
            self._grants.popleft()

    def blocks_per_s(self, now: float) -> float | None:
        """Blocks granted per second of waiting time lately; None before ``min_grants``."""
        clock = self._clock(now)
        recent = [(at, blocks) for at, blocks in self._grants if at >= clock - self.window_s]
        if len(recent) < self.min_grants:
            return None
        span = clock - recent[0][0]  # from the first grant: its blocks came before the span
        return sum(blocks for _, blocks in recent[1:]) / span if span > 0 else None

    def wait_s(self, now: float, deficit: int) -> float | None:
        """Seconds a waiter ``deficit`` blocks short (its own and those ahead of it, less the
        free ones) may expect to wait; None without an estimate."""
        pace = self.blocks_per_s(now)
        if not pace:  # none yet, or grants that took no new block: no telling
            return None
        return seconds_for(deficit, pace)


def seconds_for(deficit: int, blocks_per_s: float) -> float:
    """Seconds until ``deficit`` blocks (none: 0) are granted at ``blocks_per_s``."""
    return max(deficit, 0) / blocks_per_s
