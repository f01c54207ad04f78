"""Load-balanced choice of the (prefill, decode) pair for each request.

Worker loads are polled in the background; between polls the router counts what it dispatched
itself, so a burst of requests spreads out instead of piling onto the worker that looked idle at
the last poll. Prefill cost: prompt tokens queued. Decode cost: running requests, then free blocks.

A worker that did not answer the last poll (busy, stopped, restarting) is *stale*: pairs of fresh
workers are chosen first, a stale worker only when no fresh pair is left, and a worker silent for
``STALE_GRACE_S`` is not chosen at all (NoWorkerError when nothing else is left). So a machine
too busy to answer a poll in time slows requests down instead of failing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from coordinator.errors import NoWorkerError
from engine.outputs import EngineStats
from engine.worker.contracts import WorkerLoad

log = logging.getLogger(__name__)
STALE_GRACE_S = 30.0


@dataclass
class WorkerState:
    role: str
    instance: int
    stats: EngineStats = field(default_factory=EngineStats)  # as of the last poll
    pending_tokens: int = 0  # prompt tokens dispatched here since the last poll
    pending_requests: int = 0
    fresh: bool = True  # answered the last poll
    last_seen: float = field(default_factory=time.monotonic)

    def reachable(self, now: float) -> bool:
        return self.fresh or now - self.last_seen < STALE_GRACE_S

    @property
    def prefill_cost(self) -> float:
        return self.stats.num_waiting_prompt_tokens + self.pending_tokens

    @property
    def decode_cost(self) -> tuple[float, float]:
        running = self.stats.num_running + self.stats.num_reserved
        return (running + self.pending_requests, -self.stats.num_free_blocks)


class Router:
    def __init__(self, cluster: Any, poll_interval_s: float = 0.25) -> None:
        self.cluster = cluster
        self.poll_interval_s = poll_interval_s
        self.prefills: list[WorkerState] = []
        self.decodes: list[WorkerState] = []
        self._task: asyncio.Task | None = None
        self.latest_loads: list[WorkerLoad] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _bind(self) -> None:
        """Worker states for the cluster's actors (known once it has started)."""
        cluster = self.cluster
        single = cluster.config.deploy_mode == "single_node"
        if not self.decodes:
            self.prefills = [WorkerState("prefill", i) for i in range(len(cluster.prefills))]
            count = len(cluster.colocated if single else cluster.decodes)
            self.decodes = [
                WorkerState("colocated" if single else "decode", i) for i in range(count)
            ]

    async def refresh(self) -> list[WorkerLoad]:
        self._bind()
        loads = await self.cluster.loads()
        self.latest_loads = loads
        seen = {(load.role, load.instance) for load in loads}
        now = time.monotonic()
        for worker in [*self.prefills, *self.decodes]:
            worker.fresh = (worker.role, worker.instance) in seen
            if worker.fresh:
                worker.last_seen = now
        for load in loads:
            state = self._state(load.role, load.instance)
            if state is not None:
                state.stats, state.pending_tokens, state.pending_requests = load.stats, 0, 0
        return loads

    def _state(self, role: str, instance: int) -> WorkerState | None:
        pool = self.prefills if role == "prefill" else self.decodes
        return pool[instance] if instance < len(pool) else None

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a poll must never kill the router
                log.exception("load poll failed")
            await asyncio.sleep(self.poll_interval_s)

    def choose(
        self, num_prompt_tokens: int, exclude: AbstractSet[tuple[int, int]] = frozenset()
    ) -> tuple[int, int]:
        """The least-loaded pair not in ``exclude``, fresh if possible (module docstring);
        NoWorkerError if none is left."""
        now = time.monotonic()
        pairs = self._pairs(exclude, lambda w: w.fresh) or self._pairs(
            exclude, lambda w: w.reachable(now)
        )
        if not pairs:
            raise NoWorkerError("no prefill/decode worker pair is available")
        p, d = min(
            pairs, key=lambda pair: (pair[0].prefill_cost if pair[0] else 0, pair[1].decode_cost)
        )
        if p is not None:
            p.pending_tokens += num_prompt_tokens
        d.pending_requests += 1
        return (p.instance if p else 0, d.instance)

    def _pairs(
        self, exclude: AbstractSet[tuple[int, int]], usable: Callable[[WorkerState], bool]
    ) -> list[tuple[WorkerState | None, WorkerState]]:
        prefills: list[WorkerState | None] = [p for p in self.prefills if usable(p)]
        if not self.prefills:  # single_node: the colocated worker does it all
            prefills = [None]
        return [
            (p, d)
            for p in prefills
            for d in self.decodes
            if usable(d) and (p.instance if p else 0, d.instance) not in exclude
        ]
