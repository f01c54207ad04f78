"""What the predict app's door admits, as configured (``request_limit.*``): the budget of
buffered request bodies, and each tenant's own limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_BUFFERED_BODY_MB = 256


@dataclass(frozen=True)
class DoorLimits:
    """``max_buffered_body_mb``: the request bodies held at once
    (:mod:`~coordinator.api.body_budget`)."""

    max_buffered_body_mb: int = DEFAULT_BUFFERED_BODY_MB


DEFAULT_DOOR_LIMITS = DoorLimits()


def door_limits(request_limit: Mapping[str, Any]) -> DoorLimits:
    """The door's limits from the ``request_limit`` section of the configuration."""
    return DoorLimits(max_buffered_body_mb=request_limit["max_buffered_body_mb"])
