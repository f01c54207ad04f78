"""Growing and shrinking an elastic pool (``max_workers``; the planner's ``scale_up`` and
``scale_down`` in ``execute`` mode).

``grow`` starts one more elastic worker in the role asked for: its actor asks Ray for
``decode_resources`` (on KubeRay an autoscaler adds a node when none has room) and the pool
routes to it once it has loaded its model and answered. Until then it is *starting*: the planner
makes no other move meanwhile. ``release`` retires a worker as a switch drains one (its decoding
requests handed on to the others, token-identically; its prompts finished), then stops its actor;
its number is not used again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from workers.contracts import RoleState

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # a worker not up by then (no room, a failed load) is given up
RELEASE_WAIT_S = 60.0  # the longest a retiring worker's drain is waited for


class PoolSize:
    def __init__(self, fleet: Any, view: Any) -> None:
        """``fleet``: the elastic fleet; ``view``: its router's ``WorkerView``."""
        self.fleet, self.view = fleet, view
        self.starting = 0  # workers asked for and not up yet

    @property
    def size(self) -> int:
        """The workers in the pool, those starting included."""
        return sum(actor is not None for actor in self.fleet.elastic)

    async def grow(self, role: str, timeout_s: float = START_TIMEOUT_S) -> int | None:
        """Start one more worker serving ``role``: its number once it is up, None if it could
        not start within ``timeout_s`` (it is stopped)."""
        fleet = self.fleet
        if self.size >= fleet.config.max_workers:
            raise ValueError(f"the pool holds max_workers ({fleet.config.max_workers}) already")
        instance = len(fleet.elastic)
        fleet.elastic.append(fleet.elastic_actor(instance, role))
        self.view.hold(instance, role)  # not routed to until up
        self.starting += 1
        try:
            identity = await asyncio.wait_for(fleet.elastic[instance].ready.remote(), timeout_s)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            log.warning("elastic worker %d (%s) did not start: %r", instance, role, exc)
            self._drop(instance)
            return None
        finally:
            self.starting -= 1
        fleet.identities[("elastic", instance)] = identity
        fleet.roles[instance] = RoleState(role)
        self.view.sort_roles()
        log.info("elastic worker %d started serving %s", instance, role)
        return instance

    async def release(self, instance: int, wait_s: float = RELEASE_WAIT_S) -> str:
        """Retire worker ``instance`` and stop it: "" once stopped, else why not (it refused:
        a stale epoch, or a switch under way)."""
        fleet = self.fleet
        actor = fleet.worker("elastic", instance)
        known = self.view.hold(instance)
        assert known is not None  # a worker started has a role state
        try:
            refusal, state = await actor.retire.remote(known.epoch, wait_s)
        except ray.exceptions.RayError as exc:
            refusal, state = f"no answer: {type(exc).__name__}", known
        if refusal or state.switching:
            fleet.roles[instance] = state
            self.view.sort_roles()
            return refusal or f"its drain did not end within {wait_s:g} s"
        self._drop(instance)
        log.info("elastic worker %d released", instance)
        return ""

    def _drop(self, instance: int) -> None:
        fleet = self.fleet
        actor, fleet.elastic[instance] = fleet.elastic[instance], None
        fleet.roles.pop(instance, None)
        fleet.identities.pop(("elastic", instance), None)
        if fleet.streams.connected(("elastic", instance)):
            fleet.streams.disconnect(("elastic", instance))
        self.view.sort_roles()
        if actor is not None:
            ray.kill(actor, no_restart=True)
