"""Coordinators' leases on a worker: a coordinator that stops renewing loses its requests here.

Every request on a worker names the coordinator that sent it (``GenerationRequest.owner``). A
coordinator renews its lease with each load poll (every ``load_poll_interval_ms``, 1 s by
default, on a Ray thread group no other call uses) and with every other call that names it (a
request sent, a reservation, an abort, a router's long poll); its first request takes one. A
lease not renewed for ``lease_s`` has lapsed: the worker aborts every request of that owner,
freeing its blocks, reservation and queue (``WorkerRuntime.on_housekeeping``), and forgets the
owner. The other coordinators' requests are untouched. The owner "" (a caller outside any
coordinator, as in tests) holds no lease and never lapses.
"""

from __future__ import annotations

import threading
import time

LEASE_S = 6.0  # with housekeeping every second, a dead coordinator's requests end within ~7 s


class Leases:
    def __init__(self, lease_s: float = LEASE_S) -> None:
        self.lease_s = lease_s
        self._renewed: dict[str, float] = {}  # owner -> when its lease was last renewed
        self._lock = threading.Lock()
        self.num_expired = 0

    def renew(self, owner: str, now: float | None = None) -> None:
        if owner:
            with self._lock:
                self._renewed[owner] = time.monotonic() if now is None else now

    def live(self, now: float | None = None) -> list[str]:
        """Owners whose lease has not lapsed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [o for o, t in self._renewed.items() if now - t <= self.lease_s]

    def take_expired(self, now: float | None = None) -> list[str]:
        """Owners whose lease lapsed, forgotten here (counted in ``num_expired``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [o for o, t in self._renewed.items() if now - t > self.lease_s]
            for owner in expired:
                del self._renewed[owner]
            self.num_expired += len(expired)
            return expired


class PlannerLease:
    """Which coordinator plans roles (``coordinator/planner/loop.py``): the one whose claim here
    was last renewed within ``ttl_s``; another takes over once it lapses. Held on one worker of
    the pool (the first), so every coordinator in front of the pool asks the same one."""

    def __init__(self) -> None:
        self._holder = ""
        self._until = 0.0
        self._lock = threading.Lock()

    def claim(self, holder: str, ttl_s: float, now: float | None = None) -> bool:
        """Take or renew the lease for ``holder``; False while another holds it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._holder not in ("", holder) and now < self._until:
                return False
            self._holder, self._until = holder, now + ttl_s
            return True
