"""The role planner's Prometheus families (``coordinator/planner/loop.py``): declared when the
planner starts, so a coordinator without one exports none of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from coordinator.planner.planner import DECODE, KINDS, PREFILL, Decision

TARGETS = {PREFILL: "ttft", DECODE: "itl"}  # the role short of workers -> the target violated


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.decisions = Counter(
            "planner_decisions",
            "Role planner decisions by kind (none, switch, scale_up, scale_down) and the role a "
            "switch or a new worker takes",
            ["model_name", "kind", "role"],
            registry=registry,
        )
        self.violated = Gauge(
            "planner_targets_violated",
            "1 when the planner's last interval found the target violated (ttft, itl)",
            ["model_name", "target"],
            registry=registry,
        )
        self.advised = Gauge(
            "planner_advised_workers",
            "The workers of each role the planner's last decision advises",
            ["model_name", "role"],
            registry=registry,
        )
        self.is_leader = Gauge(
            "planner_leader", "1 on the coordinator that holds the role planner's lease",
            ["model_name"], registry=registry,
        )  # fmt: skip
        for kind in KINDS:  # every kind from the start: rate() sees the first decision
            self.decisions.labels(model_name, kind, "")

    def leader(self, leading: bool) -> None:
        self.is_leader.labels(self.model_name).set(1 if leading else 0)

    def record(self, decision: Decision, short: list[str], advised: dict[str, int]) -> None:
        self.decisions.labels(self.model_name, decision.kind, decision.role or "").inc()
        for role, target in TARGETS.items():
            self.violated.labels(self.model_name, target).set(1 if role in short else 0)
        for role, count in advised.items():
            self.advised.labels(self.model_name, role).set(count)
