"""Elastic workers' Prometheus families (``elastic_roles``): declared at the first load poll
that reports an elastic worker, so a service without them exports none of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from workers.contracts import WorkerLoad
from workers.role_gate import ROLES

OUTCOMES = ("accepted", "refused", "failed")  # started; a stale epoch, ...; no answer


class RoleMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.epoch = Gauge(
            "worker_role_epoch",
            "An elastic worker's role epoch (its switches so far), labelled with the role it "
            "serves (switching: a switch is under way)",
            ["model_name", "role", "instance", "serving"],
            registry=registry,
        )
        self.switches = Counter(
            "worker_role_switches",
            "Role switches asked of elastic workers, by the role switched to and the outcome "
            "(accepted; refused: a stale epoch, or the worker serves that role; failed: no "
            "answer)",
            ["model_name", "to", "outcome"],
            registry=registry,
        )
        self.migrations = Counter(
            "request_role_switch_migrations",
            "Requests handed on to another worker because theirs switched roles (token-"
            "identical, spending none of their retries; not failures)",
            ["model_name"],
            registry=registry,
        )
        for role in ROLES:  # every series from the start: rate() sees the first switch
            for outcome in OUTCOMES:
                self.switches.labels(model_name, role, outcome)
        self.migrations.labels(model_name)
        self._serving: dict[str, str] = {}  # instance -> the serving label set

    def record_loads(self, loads: list[WorkerLoad]) -> None:
        for load in loads:
            if load.role_state is None:
                continue
            instance, state = str(load.instance), load.role_state
            serving = "switching" if state.switching else state.serving
            previous = self._serving.get(instance)
            if previous is not None and previous != serving:
                self.epoch.remove(self.model_name, load.role, instance, previous)
            self._serving[instance] = serving
            self.epoch.labels(self.model_name, load.role, instance, serving).set(state.epoch)

    def switched(self, to: str, outcome: str) -> None:
        self.switches.labels(self.model_name, to, outcome).inc()

    def migrated(self) -> None:
        self.migrations.labels(self.model_name).inc()
