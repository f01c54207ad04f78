"""The role planner (``planner.py``), its step-time model (``capacity.py``), what it learns of
the traffic (``traffic.py``) and its loop in the coordinator (``loop.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

PLANNER_MODES = ("off", "advise", "execute")


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's keys: ``advise`` runs it on the live figures and publishes each decision as
    a metric and a log line; ``execute`` also carries out its switches (``elastic_roles``)."""

    mode: str = "off"
    slo_ttft_ms: int = 2000
    slo_itl_ms: int = 100
    interval_ms: int = 2000

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            modes = ", ".join(PLANNER_MODES)
            raise ConfigError(f"planner must be one of {modes}, got {self.mode!r}")

    @property
    def slo_ttft_s(self) -> float:
        return self.slo_ttft_ms / 1000

    @property
    def slo_itl_s(self) -> float:
        return self.slo_itl_ms / 1000

    @property
    def interval_s(self) -> float:
        return self.interval_ms / 1000
