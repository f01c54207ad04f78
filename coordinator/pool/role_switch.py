"""Switching an elastic worker's role from a coordinator (``elastic_worker/worker.py``): the
management call ``POST /v1/instances/{n}/role`` and the planner in ``execute`` mode.

The router stops sending the worker new work at once (it is in neither of its role lists while
it switches); the worker drains and flips; the router takes it back in its new role as soon as
the switch answers (other coordinators, at their next load poll; until then the worker refuses
their calls and their requests go elsewhere). Each switch asked is counted by its outcome
(``worker_role_switches_total``) and logged.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from workers.contracts import RoleState

log = logging.getLogger(__name__)


class RoleSwitcher:
    def __init__(self, view: Any, metrics: Any | None = None) -> None:
        """``view``: the router's ``WorkerView`` (its fleet does the call); ``metrics``: the
        service's ``Metrics`` (None: none kept)."""
        self.view, self.fleet, self.metrics = view, view.fleet, metrics

    async def switch(self, instance: int, target: str, wait_s: float) -> tuple[str, RoleState]:
        """Switch elastic worker ``instance`` to ``target``, waiting up to ``wait_s`` for it to
        end: ("", its role then), or (why not, its role now). ValueError or IndexError when
        there is no such elastic worker, RayError when it does not answer."""
        self.fleet.worker("elastic", instance)  # no such worker: raises before anything moves
        known = self.fleet.roles[instance]
        if not known.switching and known.serving != target:
            self.view.hold(instance)
        try:
            refusal, state = await self.fleet.switch(instance, target, wait_s)
        except ray.exceptions.RayError:
            self.fleet.roles[instance] = known
            self._count(target, "failed")
            raise
        finally:
            self.view.sort_roles()
        self._count(target, "refused" if refusal else "accepted")
        log.info("elastic worker %d to %s: %s; it serves %s at epoch %d%s", instance, target,
                 refusal or "accepted", state.serving, state.epoch,
                 " (switching)" if state.switching else "")  # fmt: skip
        return refusal, state

    def _count(self, target: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.role_metrics().switched(target, outcome)
