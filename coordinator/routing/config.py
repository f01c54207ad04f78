"""How the router weighs loads and cached prefixes: :class:`RoutingConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import CacheConfig
from engine.errors import ConfigError


@dataclass(frozen=True)
class RoutingConfig:
    """How the router weighs cached prefixes (``coordinator/router.py``); built from
    ``digs_scheduler_config`` and ``backend_config`` by ``served_model.routing_config``."""

    prefix_routing: bool = True  # False: pairs by load only
    block_size: int = CacheConfig.block_size  # the engines' cacheBlockSize
    max_prefill_imbalance: int = 8192  # queued prompt tokens over the least loaded prefill
    max_decode_imbalance: int = 4  # running requests over the least loaded decode
    prefix_ttl_s: float = 600.0  # an index entry not routed again for this long expires
    # pd_separate: the decode worker prefills a prompt itself (no hand-off) when what it would
    # compute is at most local_prefill_tokens (0: never), or is less than the chosen prefill
    # worker's queue once that queue reaches local_prefill_queue_tokens (0: never)
    local_prefill_tokens: int = 96
    local_prefill_queue_tokens: int = 1024
    local_prefill_fallback: bool = True  # no prefill worker answers: decode workers prefill
    # requests one decode (or colocated) worker may hold, running, waiting or reserved; a new
    # request finding every worker at it is refused (429) instead of queued (0: no cap)
    max_requests_per_worker: int = 0
    # how often the workers' loads are polled (routing/worker_view.py): each poll is a Ray call
    # to every worker, a few ms of the coordinator's CPU each; between polls it counts what it sent
    load_poll_interval_ms: int = 1000
    # pd_separate: a prefill worker may pull a prompt's leading blocks from a peer that holds
    # them (kv_peer_pull; routing/pull_cost.py)
    peer_pull: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "prefix_ttl_s", "load_poll_interval_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"routing {name} must be positive, got {getattr(self, name)}")
        for name in (
            "max_prefill_imbalance",
            "max_decode_imbalance",
            "local_prefill_tokens",
            "local_prefill_queue_tokens",
            "max_requests_per_worker",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be at least 0, got {getattr(self, name)}")
