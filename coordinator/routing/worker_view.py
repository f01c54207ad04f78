"""What the router knows of each worker, kept up to date in the background.

A load poll every ``poll_interval_s`` asks every worker at once (``Fleet.reports``): its stats
(queues, running, free blocks), its pid, and its prefix-cache events after this router's cursor,
which go into the cache view (``cache_view.py``), loading a snapshot after a gap or a restart. The
poll also renews this coordinator's lease on every worker. A worker that did not answer the last
poll (busy, stopped, restarting) is *stale*; one silent for ``STALE_GRACE_S`` is lost, and its
cache view is dropped (it comes back, if ever, with an empty cache). So is the record of what was
sent to a worker that restarted (another pid) or is idle with no cached block.

While other coordinators share the workers, each worker's events are also followed by a long
poll: it waits up to ``FOLLOW_WAIT_S`` for the next event and returns at most every
``FOLLOW_BATCH_S`` (events batch up meanwhile), so a block stored on a worker reaches every router
within ~``FOLLOW_BATCH_S``, not at its next load poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from coordinator.routing.cache_view import CacheView
from coordinator.routing.worker_state import WorkerKey, WorkerState
from engine.outputs import EngineStats
from workers.contracts import RoleState, WorkerLoad, WorkerReport

log = logging.getLogger(__name__)
FOLLOW_WAIT_S = 2.0
FOLLOW_BATCH_S = 0.1


class WorkerView:
    def __init__(self, fleet: Any, cache: CacheView, poll_interval_s: float) -> None:
        self.fleet = fleet  # the workers (coordinator.pool.fleet.Fleet)
        self.owner: str = getattr(fleet, "coordinator_id", "")  # this coordinator's requests'
        self.cache = cache
        self.poll_interval_s = poll_interval_s
        self.prefills: list[WorkerState] = []
        self.decodes: list[WorkerState] = []  # the colocated workers in single_node
        self.last_loads: dict[WorkerKey, WorkerLoad] = {}  # each worker's latest answer
        self.latest_reports: list[WorkerReport] = []
        # told each poll's reports (the cluster shares decode workers' places by them)
        self.on_reports: Callable[[list[WorkerReport]], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self._followers: dict[WorkerKey, asyncio.Task] = {}  # each worker's event long poll
        # elastic workers by instance (each in ``prefills`` or ``decodes`` by the role it
        # serves, in neither while it switches)
        self.elastic: dict[int, WorkerState] = {}
        self._asking_roles: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Poll loads, and follow every worker's events, until ``stop``."""
        loop = asyncio.get_running_loop()
        self.bind()
        self._tasks = [loop.create_task(self._poll_forever())]
        self._followers = {w.key: loop.create_task(self._follow_forever(w)) for w in self.all()}

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._followers.values()]
        self._tasks, self._followers = [], {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def bind(self) -> None:
        """Worker states for the fleet's actors (known once it has started)."""
        fleet = self.fleet
        single = fleet.config.deploy_mode == "single_node"
        if getattr(fleet, "elastic", None) and not self.elastic:
            self.elastic = {
                n: WorkerState("elastic", n, role_state=fleet.roles.get(n))
                for n in range(len(fleet.elastic))
            }
            self.sort_roles()
        elif not self.decodes:
            self.prefills = [WorkerState("prefill", i) for i in range(len(fleet.prefills))]
            count = len(fleet.colocated if single else fleet.decodes)
            self.decodes = [
                WorkerState("colocated" if single else "decode", i) for i in range(count)
            ]

    async def refresh(self) -> list[WorkerLoad]:
        """One load poll (module docstring); the loads of the workers that answered."""
        self.bind()
        reports = await self.fleet.reports(self.cache.cursors())
        loads = [report.load for report in reports]
        self.latest_reports = reports
        if self.on_reports is not None:
            self.on_reports(reports)
        seen = {(load.role, load.instance) for load in loads}
        self.last_loads |= {(load.role, load.instance): load for load in loads}
        now = time.monotonic()
        for worker in self.all():
            worker.fresh = worker.key in seen
            if worker.fresh:
                worker.last_seen = now
            elif not worker.reachable(now):
                self.cache.drop(worker.key)  # lost: back, if ever, with an empty cache
        for report in reports:
            load = report.load
            state = self.state(load.role, load.instance)
            if state is not None:
                self._forget_lost_cache(state, load)
                state.stats, state.pending_tokens, state.pending_requests = load.stats, 0, 0
                state.num_others_requests = sum(
                    n for owner, n in load.requests_by_owner.items() if owner != self.owner
                )
                state.pid = load.pid
                await self._follow_events(state, report)
        self.sort_roles()
        return loads

    @property
    def latest_loads(self) -> list[WorkerLoad]:
        """The loads of the workers that answered the last poll."""
        return [report.load for report in self.latest_reports]

    def workers(self) -> list[tuple[WorkerState, WorkerLoad | None]]:
        """Every worker of the fleet, answering or not, with the load it last reported (None:
        not heard from yet)."""
        self.bind()
        return [(w, self.last_loads.get(w.key)) for w in self.all()]

    def all(self) -> list[WorkerState]:
        """Every worker's state, whichever role it serves or switches to."""
        if self.elastic:
            return list(self.elastic.values())
        return [*self.prefills, *self.decodes]

    def state(self, role: str, instance: int) -> WorkerState | None:
        if role == "elastic":
            return self.elastic.get(instance)
        pool = self.prefills if role == "prefill" else self.decodes
        return pool[instance] if instance < len(pool) else None

    def hold(self, instance: int, serving: str = "") -> RoleState | None:
        """Route no new work to elastic worker ``instance`` from now on (a switch, a start or a
        release under way): its role state as known until then, None for a worker not known
        yet (one starting, to serve ``serving``)."""
        known = self.fleet.roles.get(instance)
        held = RoleState(serving, switching=True) if known is None else known
        self.fleet.roles[instance] = dataclasses.replace(held, switching=True)
        self.sort_roles()
        return known

    def sort_roles(self) -> None:
        """Elastic workers into ``prefills`` and ``decodes`` by the role each serves as the
        fleet last heard (one switching is in neither: it takes no new work)."""
        if not self.elastic:
            return
        self._resize()
        for instance, state in self.elastic.items():
            state.role_state = self.fleet.roles.get(instance, state.role_state)
        states = [s for s in self.elastic.values() if not s.switching]
        self.prefills = [s for s in states if s.serving == "prefill"]
        self.decodes = [s for s in states if s.serving == "decode"]

    def _resize(self) -> None:
        """Follow the pool's size: a state for each worker started since, none for those
        released (their cache view dropped, their long poll stopped)."""
        roles = self.fleet.roles
        for instance in [n for n in self.elastic if n not in roles]:
            state = self.elastic.pop(instance)
            self.cache.drop(state.key)
            self.last_loads.pop(state.key, None)
            follower = self._followers.pop(state.key, None)
            if follower is not None:
                follower.cancel()
        for instance in [n for n in roles if n not in self.elastic]:
            state = WorkerState("elastic", instance, role_state=roles[instance])
            self.elastic[instance] = state
            if self._tasks:  # started: follow its events too
                task = asyncio.get_running_loop().create_task(self._follow_forever(state))
                self._followers[state.key] = task

    async def refresh_roles(self) -> None:
        """Ask every elastic worker its role now (a request was refused or handed on by a
        switch this view had not heard of); callers at once share one round of calls."""
        if not self.elastic:
            return
        if self._asking_roles is None or self._asking_roles.done():
            self._asking_roles = asyncio.ensure_future(self.fleet.role_states())
        await asyncio.shield(self._asking_roles)
        self.sort_roles()

    def shared(self) -> bool:
        """Whether another coordinator holds a lease on any worker, as of the last poll."""
        return any(report.num_coordinators > 1 for report in self.latest_reports)

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a poll must never kill the router
                log.exception("load poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def _follow_forever(self, state: WorkerState) -> None:
        """Long-poll ``state``'s worker for its prefix-cache events and apply them as they come
        (a gap or another epoch is left to the load poll, which resynchronises)."""
        while True:
            epoch, seq = self.cache.cursor(state.key)
            if seq < 0 or not state.fresh or not self.shared():
                # not in sync yet, not answering, or no other coordinator routes to the workers
                # (what this one routed counts at once): the load poll's events suffice
                await asyncio.sleep(self.poll_interval_s)
                continue
            try:
                batch = await self.fleet.kv_events(*state.key, epoch, seq, FOLLOW_WAIT_S)
            except Exception as exc:  # dead or restarting: the load poll notices it
                log.debug("events of %s worker %d: %r", *state.key, exc)
                await asyncio.sleep(self.poll_interval_s)
                continue
            if not batch.gap and batch.epoch == self.cache.cursor(state.key)[0]:
                self.cache.apply(state.key, batch, state.stats.num_total_blocks)
            await asyncio.sleep(FOLLOW_BATCH_S)

    async def _follow_events(self, state: WorkerState, report: WorkerReport) -> None:
        """Apply a worker's prefix-cache events; after a gap or a restart, load its snapshot
        (a failed snapshot is asked for again at the next poll)."""
        if not self.cache.apply(state.key, report.kv_events, state.stats.num_total_blocks):
            return
        try:
            snapshot = await self.fleet.kv_snapshot(*state.key)
        except Exception as exc:  # the next poll reports the gap again
            log.warning("prefix cache snapshot of %s worker %d failed: %r", *state.key, exc)
            return
        self.cache.load(state.key, snapshot)
        log.info(
            "%s worker %d: prefix cache view resynchronised (%d blocks, event %d)",
            *state.key,
            len(snapshot.hashes),
            snapshot.seq,
        )

    def _forget_lost_cache(self, state: WorkerState, load: WorkerLoad) -> None:
        """Forget what was sent to a worker whose cache is gone: its actor restarted, or it is
        idle (nothing on its way to it either) and reports no cached block."""
        restarted = state.pid != 0 and load.pid != state.pid
        sent = state.pending_tokens or state.pending_requests  # maybe not there at the poll
        emptied = load.stats.num_cached_blocks == 0 and _is_idle(load.stats) and not sent
        if (restarted or emptied) and self.cache.num_dispatched(state.key):
            why = f"restarted (pid {state.pid} -> {load.pid})" if restarted else "has no cache"
            log.info("%s worker %d %s: what was sent there is forgotten", *state.key, why)
            self.cache.forget_dispatches(state.key)


def _is_idle(stats: EngineStats) -> bool:
    return stats.num_waiting + stats.num_running + stats.num_held + stats.num_reserved == 0
