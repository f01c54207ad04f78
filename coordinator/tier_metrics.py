"""The KV tiers' Prometheus families (``engine/kv_tiers``), per worker and tier: declared when
the first worker reports a tier, so a service without tiers exports no empty families of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from coordinator.polled_counter import PolledCounter
from engine.outputs import EngineStats

WORKER = ("role", "instance")
TIER = (*WORKER, "tier")
# TierStats field -> (family, help) of the counters each tier feeds
TIER_COUNTERS = {
    "hits": ("kv_tier_hits", "KV blocks a tier served to a prompt instead of computing them"),
    "stored": ("kv_tier_stored", "KV blocks written to a tier"),
    "evicted": ("kv_tier_evicted", "KV blocks a tier deleted to stay within its cap"),
    "corrupt": ("kv_tier_corrupt", "Tier files refused by their checks (computed instead)"),
    "failed_writes": ("kv_tier_failed_writes", "Writes to a tier that failed (skipped)"),
    "load_seconds": ("kv_tier_load_seconds", "Seconds spent reading blocks a tier served"),
}


class TierMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ["model_name", *TIER], registry=registry)

        def polled(name: str, documentation: str, *labels: str) -> PolledCounter:
            return PolledCounter(
                Counter(name, documentation, ["model_name", *labels], registry=registry)
            )

        self.blocks = gauge("kv_tier_blocks", "KV blocks a tier holds")
        self.bytes = gauge("kv_tier_bytes", "Bytes of KV block files a tier holds")
        self.capacity = gauge("kv_tier_capacity_bytes", "A tier's cap, in bytes")
        self.counters = {
            field: polled(name, documentation, *TIER)
            for field, (name, documentation) in TIER_COUNTERS.items()
        }
        self.demoted = polled(
            "kv_tier_demotions", "Evicted KV blocks a worker queued for its tiers", *WORKER
        )
        self.skipped = polled(
            "kv_tier_demotions_skipped",
            "Evicted KV blocks a worker dropped instead: its tier writer was too far behind",
            *WORKER,
        )
        self.promoted = polled(
            "kv_tier_promotions", "KV blocks a worker loaded from its tiers into its cache", *WORKER
        )

    def record(self, labels: tuple[str, ...], pid: int, stats: EngineStats) -> None:
        """A worker's figures; ``labels``: model name, role, instance."""
        for tier in stats.kv_tiers:
            tiered = (*labels, tier.name)
            self.blocks.labels(*tiered).set(tier.blocks)
            self.bytes.labels(*tiered).set(tier.bytes)
            self.capacity.labels(*tiered).set(tier.capacity_bytes)
            for field, counter in self.counters.items():
                counter.observe(tiered, pid, getattr(tier, field))
        self.demoted.observe(labels, pid, stats.kv_tier_demoted)
        self.skipped.observe(labels, pid, stats.kv_tier_skipped)
        self.promoted.observe(labels, pid, stats.kv_tier_promoted)
