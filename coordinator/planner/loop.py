"""The role planner in a coordinator (``planner: advise`` or ``execute``): every ``interval_s``
the coordinator holding the planner's lease (claimed on the pool's first worker, renewed each
interval, another coordinator taking over within ``LEASE_INTERVALS`` intervals of its silence)
gives the planner the workers as its router last polled them and the interval's traffic, and
publishes the decision: ``planner_decisions_total{kind, role}``,
``planner_targets_violated{target}``, the split it advises (``planner_advised_workers{role}``)
and a log line when the advice changes.

``execute`` (elastic workers) carries out each switch decided: the workers named switch roles
(``coordinator/pool/role_switch.py``), each on a task of its own, the loop not waiting for them;
the planner moves nothing more while a worker reports a switch under way. A worker counts as
cold (its step times not fitted) for its first ``WARM_STEPS`` steps in a role. With
``max_workers`` its scaling decisions are carried out too (``coordinator/pool/pool_size.py``):
one more worker of the short role started, or the worker named released; nothing else moves
while a worker starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from coordinator.planner import PlannerSettings
from coordinator.planner.planner import (
    DECODE,
    PREFILL,
    SCALE_DOWN,
    SCALE_UP,
    SWITCH,
    Decision,
    Planner,
    PlannerConfig,
    WorkerSample,
)
from coordinator.planner.traffic import TrafficWindow
from coordinator.routing.worker_state import WorkerState

log = logging.getLogger(__name__)

LEASE_INTERVALS = 3  # a lease lapses after this many intervals without a renewal
WARM_STEPS = 20  # a worker's first steps run cold (kernels, caches): the planner skips them


class PlannerLoop:
    def __init__(
        self,
        settings: PlannerSettings,
        view: Any,  # coordinator.routing.worker_view.WorkerView
        fleet: Any,  # coordinator.pool.fleet.Fleet
        traffic: TrafficWindow,
        split: tuple[int, int],
        metrics: Any | None = None,  # coordinator.planner_metrics.PlannerMetrics
        switcher: Any | None = None,  # coordinator.pool.role_switch.RoleSwitcher (execute)
        pool: Any | None = None,  # coordinator.pool.pool_size.PoolSize (execute, max_workers)
    ) -> None:
        """``split``: the configured prefill and decode workers (where an idle pool returns)."""
        self.settings, self.view, self.fleet, self.traffic = settings, view, fleet, traffic
        self.metrics = metrics
        self.switcher = switcher if settings.mode == "execute" else None
        self.pool = pool if self.switcher is not None else None
        max_workers = self.pool.fleet.config.max_workers if self.pool is not None else 0
        self._moves: set[asyncio.Task] = set()
        prefills, decodes = split
        self._steps: dict[str, int] = {}  # worker -> its steps at the last sample
        self.planner = Planner(PlannerConfig(
            slo_ttft_s=settings.slo_ttft_s, slo_itl_s=settings.slo_itl_s,
            interval_s=settings.interval_s, default_prefill=prefills, default_decode=decodes,
            max_workers=max_workers,
        ))  # fmt: skip
        self.leader = False
        self.last: Decision | None = None
        self._advice = ""

    async def run(self) -> None:
        """Decide every interval until cancelled."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick()
            except Exception:  # the loop outlives a bad interval (a worker gone mid-call)
                log.exception("role planner interval failed")

    async def tick(self, now: float | None = None) -> Decision | None:
        """One interval: the decision, or None when another coordinator plans."""
        sample = self.traffic.take(self.settings.interval_s)
        self.leader = await self._claim()
        if self.metrics is not None:
            self.metrics.leader(self.leader)
        if not self.leader:
            return None
        workers = [self._sample(w) for w in self.view.all() if w.fresh]
        if not workers:
            return None
        # this coordinator's traffic stands for its pool's: one share of the coordinators'
        sharing = max((r.num_coordinators for r in self.view.latest_reports), default=1)
        starting = self.pool.starting if self.pool is not None else 0
        sample = dataclasses.replace(
            sample, arrivals=sample.arrivals * max(sharing, 1), starting=starting
        )
        decision = self.planner.decide(workers, sample, time.monotonic() if now is None else now)
        self.last = decision
        if self.metrics is not None:
            self.metrics.record(decision, self.planner.short, _advised(workers, decision))
        advice = f"{decision.kind}:{decision.role}:{len(decision.workers)}"
        if advice != self._advice:
            self._advice = advice
            log.info("role planner: %s %s %s (%s)", decision.kind, decision.role or "",
                     ",".join(decision.workers), decision.reason)  # fmt: skip
        if self.switcher is not None and decision.kind == SWITCH and decision.role is not None:
            self._execute(decision.role, decision.workers)
        elif self.pool is not None and decision.role is not None:
            if decision.kind == SCALE_UP:
                self._start(self.pool.grow(decision.role), "starting a worker")
            elif decision.kind == SCALE_DOWN:
                for key in decision.workers:
                    instance = int(key.rsplit("-", 1)[1])
                    self._start(self.pool.release(instance), f"releasing worker {instance}")
        return decision

    def _start(self, move: Any, what: str) -> None:
        """Run ``move`` (a coroutine) on a task of its own, its failure logged."""

        async def logged() -> None:
            try:
                await move
            except Exception as exc:  # the next interval sees the pool as it is
                log.warning("role planner: %s failed: %r", what, exc)

        task = asyncio.ensure_future(logged())
        self._moves.add(task)
        task.add_done_callback(self._moves.discard)

    def _execute(self, role: str, workers: Sequence[str]) -> None:
        """Switch ``workers`` (keys ``elastic-N``) to ``role``, each on a task of its own."""
        assert self.switcher is not None
        for key in workers:
            instance = int(key.rsplit("-", 1)[1])
            move = self.switcher.switch(instance, role, 0.0)
            self._start(move, f"switching worker {instance} to {role}")

    async def _claim(self) -> bool:
        """Whether this coordinator holds the planner's lease (claimed or renewed now)."""
        first = self.fleet.actors[0] if self.fleet.actors else None
        if first is None:
            return False
        ttl = LEASE_INTERVALS * self.settings.interval_s
        try:
            claimed = await asyncio.wait_for(
                first.claim_planner.remote(self.fleet.coordinator_id, ttl), self.settings.interval_s
            )
        except (ray.exceptions.RayError, TimeoutError):
            return False  # the lease's worker is away: nobody plans until it answers
        return bool(claimed)

    def _sample(self, worker: WorkerState) -> WorkerSample:
        """The planner's view of ``worker``: its step times only when it stepped since the last
        interval (an average it reported already is no new measurement)."""
        stats, key = worker.stats, f"{worker.role}-{worker.instance}"
        stepped = stats.num_steps != self._steps.get(key)
        self._steps[key] = stats.num_steps
        role_state = worker.role_state
        steps = stats.num_steps if role_state is None else role_state.steps_in_role
        return WorkerSample(
            key=key,
            role=PREFILL if worker.serving == PREFILL else DECODE,
            queued_tokens=stats.num_prompt_tokens_to_compute,
            running=stats.num_running,
            token_s=stats.prompt_token_seconds if stepped else 0.0,
            step_s=stats.decode_step_seconds if stepped else 0.0,
            step_rows=stats.decode_step_rows,
            warm=steps >= WARM_STEPS,
            switching=worker.switching,
        )


def _advised(workers: list[WorkerSample], decision: Decision) -> dict[str, int]:
    """The workers of each role the decision advises."""
    counts = {PREFILL: 0, DECODE: 0}
    for worker in workers:
        counts[worker.role] += 1
    if decision.kind == SWITCH and decision.role is not None:
        other = DECODE if decision.role == PREFILL else PREFILL
        counts[decision.role] += len(decision.workers)
        counts[other] -= len(decision.workers)
    elif decision.kind == SCALE_UP and decision.role is not None:
        counts[decision.role] += 1
    elif decision.kind == SCALE_DOWN and decision.role is not None:
        counts[decision.role] -= 1
    return counts
