"""One worker as the router sees it: its last polled stats, what was dispatched to it since,
and whether it answers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.outputs import EngineStats
from workers.contracts import RoleState

WorkerKey = tuple[str, int]  # (role, instance)
STALE_GRACE_S = 30.0  # a worker silent this long is not chosen at all


@dataclass
class WorkerState:
    role: str
    instance: int
    stats: EngineStats = field(default_factory=EngineStats)  # as of the last poll
    pending_tokens: int = 0  # tokens to compute dispatched here since the last poll
    pending_requests: int = 0
    num_own_requests: int = 0  # this router's requests open here (Router.choose to release)
    num_others_requests: int = 0  # the other coordinators' requests here, as of the last poll
    fresh: bool = True  # answered the last poll
    last_seen: float = field(default_factory=time.monotonic)
    pid: int = 0  # of its actor at the last poll (0: not heard from yet)
    role_state: RoleState | None = None  # an elastic worker's role, as last heard

    @property
    def serving(self) -> str:
        """The role it takes requests of: an elastic worker's current one, else its ``role``."""
        return self.role_state.serving if self.role_state is not None else self.role

    @property
    def switching(self) -> bool:
        return self.role_state is not None and self.role_state.switching

    @property
    def key(self) -> WorkerKey:
        return (self.role, self.instance)

    def reachable(self, now: float) -> bool:
        return self.fresh or now - self.last_seen < STALE_GRACE_S

    def status(self, now: float) -> str:
        """``answering`` (the last poll), ``stale`` (silent for less than ``STALE_GRACE_S``:
        busy or restarting, still chosen) or ``lost`` (not chosen)."""
        if self.fresh:
            return "answering"
        return "stale" if self.reachable(now) else "lost"

    @property
    def prefill_cost(self) -> float:
        return self.stats.num_prompt_tokens_to_compute + self.pending_tokens

    @property
    def num_requests_held(self) -> int:
        """Requests here: this router's open ones, exactly, and the other coordinators' (as of
        the last poll)."""
        return self.num_own_requests + self.num_others_requests

    @property
    def decode_load(self) -> int:
        stats = self.stats
        return stats.num_running + stats.num_reserved + self.pending_requests
