"""The role planner (``planner.py``), its step-time model (``capacity.py``), what it learns of
the traffic (``traffic.py``) and its loop in the coordinator (``loop.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError

PLANNER_MODES = ("off", "advise")


@dataclass(frozen=True)
class PlannerSettings:
    """The planner's keys (``digs_scheduler_config``): ``advise`` runs it on the live figures and
    publishes each decision as a metric and a log line; workers do not change roles yet."""

    mode: str = "off"
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1
    interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ConfigError(
                f"planner must be one of {', '.join(PLANNER_MODES)}, got {self.mode!r}"
            )
