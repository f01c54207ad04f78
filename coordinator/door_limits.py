"""What the predict app's door admits, as configured (``request_limit.*``,
``http_config.api_key_priority``): the budget of buffered request bodies, and each client's own
limits (:mod:`~coordinator.api.clients`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BUFFERED_BODY_MB = 256
DEFAULT_RESPONSES_STORE_MB = 256  # the /v1/responses store (coordinator/api/responses_store.py)
DEFAULT_RESPONSES_TTL_S = 3600


@dataclass(frozen=True)
class DoorLimits:
    """``max_buffered_body_mb``: the request bodies held at once
    (:mod:`~coordinator.api.body_budget`); ``responses_*``: the bounds of the ``/v1/responses``
    store (:mod:`~coordinator.api.responses_store`); the rest: each client's limits (0: none)
    and its key's best priority (:mod:`~coordinator.api.clients`)."""

    max_buffered_body_mb: int = DEFAULT_BUFFERED_BODY_MB
    max_requests_per_key: int = 0
    tokens_per_minute_per_key: int = 0
    grammar_compiles_per_minute_per_key: int = 0
    max_constrained_requests_per_key: int = 0
    priority_by_key: Mapping[str, int] = field(default_factory=dict)
    responses_store_mb: int = DEFAULT_RESPONSES_STORE_MB  # 0: nothing stored
    responses_ttl_s: int = DEFAULT_RESPONSES_TTL_S


DEFAULT_DOOR_LIMITS = DoorLimits()


def door_limits(config: Any) -> DoorLimits:
    """The door's limits from the configuration (``CoordinatorConfig``)."""
    limit = config["request_limit"]
    return DoorLimits(
        max_buffered_body_mb=limit["max_buffered_body_mb"],
        max_requests_per_key=limit["max_requests_per_key"],
        tokens_per_minute_per_key=limit["tokens_per_minute_per_key"],
        grammar_compiles_per_minute_per_key=limit["grammar_compiles_per_minute_per_key"],
        max_constrained_requests_per_key=limit["max_constrained_requests_per_key"],
        priority_by_key=config["http_config"]["api_key_priority"],
        responses_store_mb=limit["responses_store_mb"],
        responses_ttl_s=limit["responses_ttl_s"],
    )
