"""Peer prefix pulls' Prometheus families (``kv_peer_pull``): declared at the first pull, so a
service that makes none exports no empty families of them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from coordinator.pool.prefix_pull import PullOutcome

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class PullMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.pulls = Counter(
            "kv_peer_pulls",
            "Prefix pulls from a peer worker (kv_peer_pull), by the source's role and outcome "
            "(ok: blocks installed; failed: the prompt computed them)",
            ["model_name", "source_role", "outcome"],
            registry=registry,
        )
        self.blocks = Counter(
            "kv_peer_pull_blocks", "KV blocks prefill workers pulled from peers",
            ["model_name"], registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "kv_peer_pull_seconds",
            "Time from opening a prefix pull to the peer's acknowledged pages",
            ["model_name"], buckets=SECONDS, registry=registry,
        )  # fmt: skip

    def record(self, outcome: PullOutcome) -> None:
        result = "ok" if outcome.ok else "failed"
        self.pulls.labels(self.model_name, outcome.source_role, result).inc()
        self.blocks.labels(self.model_name).inc(outcome.num_blocks)
        self.seconds.labels(self.model_name).observe(outcome.seconds)
