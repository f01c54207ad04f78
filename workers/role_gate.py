"""Which role an elastic worker (``elastic_worker/worker.py``) takes calls of, and its switch.

Every call that brings work of a role (a prompt to prefill, blocks to reserve, a request to
prefill and decode here) passes :meth:`RoleGate.admit` with the role and the epoch its sender
saw; it is refused when the worker serves another role, is switching, or has a newer epoch (the
sender's view is stale), and otherwise counted as inside until it returns. A switch
(:meth:`RoleGate.begin`) is a compare-and-set on the epoch: from then on every call is refused;
the worker drains, waits until no admitted call is still inside (``quiet``) and ``finish``-es,
which flips the role and bumps the epoch. Retiring (the pool releasing the worker) is a switch
to ``RETIRED``, a role that takes no calls.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from workers.contracts import RoleState

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
RETIRED = "retired"  # a worker released from the pool: it takes no work of either role again
ANY_EPOCH = -1  # a call that names no epoch (sent by a caller that does not track them)


class RoleGate:
    def __init__(self, serving: str) -> None:
        if serving not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {serving!r}")
        self._changed = threading.Condition()
        self.serving = serving
        self.epoch = 0
        self.target: str | None = None  # the role a switch under way goes to
        self._inside = 0  # admitted calls not returned yet
        self.num_refused = 0

    @property
    def switching(self) -> bool:
        return self.target is not None

    def state(self, steps_in_role: int = 0) -> RoleState:
        with self._changed:
            return RoleState(self.serving, self.epoch, self.switching, steps_in_role)

    @contextlib.contextmanager
    def admit(self, role: str, epoch: int = ANY_EPOCH) -> Iterator[str]:
        """Yield "" when a call of ``role`` sent at ``epoch`` may go on (counted inside until it
        leaves), else why it may not (the caller refuses it)."""
        with self._changed:
            refusal = self._refusal(role, epoch)
            if refusal:
                self.num_refused += 1
            else:
                self._inside += 1
        try:
            yield refusal
        finally:
            if not refusal:
                with self._changed:
                    self._inside -= 1
                    self._changed.notify_all()

    def _refusal(self, role: str, epoch: int) -> str:
        if self.target is not None:
            return f"this worker is switching from {self.serving} to {self.target}"
        if role != self.serving:
            return f"this worker serves {self.serving} now (epoch {self.epoch}), not {role}"
        if epoch != ANY_EPOCH and epoch != self.epoch:
            return f"stale role epoch {epoch}: this worker is at epoch {self.epoch}"
        return ""

    def begin(self, target: str, epoch: int) -> tuple[str, bool]:
        """Start switching to ``target`` (a role, or ``RETIRED``) if the worker is still at
        ``epoch``: ("", True) when this call started it, ("", False) when that very switch is
        under way already, else (why not, False)."""
        if target not in (*ROLES, RETIRED):
            return f"role must be one of {', '.join(ROLES)}, got {target!r}", False
        with self._changed:
            if self.serving == RETIRED:
                return "this worker is retired", False
            if epoch != self.epoch:
                return f"stale role epoch {epoch}: this worker is at epoch {self.epoch}", False
            if self.target is not None:
                same = self.target == target
                return ("" if same else f"already switching to {self.target}"), False
            if target == self.serving:
                return f"this worker serves {target} already", False
            self.target = target
            self._changed.notify_all()
            return "", True

    def quiet(self) -> bool:
        """Whether no admitted call is inside."""
        with self._changed:
            return self._inside == 0

    def finish(self) -> RoleState:
        """End the switch under way: the new role, at the next epoch."""
        with self._changed:
            if self.target is None:
                raise RuntimeError("no switch is under way")
            self.serving, self.target = self.target, None
            self.epoch += 1
            self._changed.notify_all()
            return RoleState(self.serving, self.epoch)

    def abandon(self) -> RoleState:
        """Give up the switch under way (its drain failed): the role and epoch stay as they
        were, calls are taken again and the next ``begin`` starts afresh."""
        with self._changed:
            self.target = None
            self._changed.notify_all()
            return RoleState(self.serving, self.epoch)

    def wait_past(self, epoch: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the epoch to pass ``epoch``; whether it did."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.epoch <= epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True
