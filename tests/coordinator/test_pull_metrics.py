"""Peer pulls on /metrics: no family before the first pull, then each pull counted by its
source's role and outcome, its blocks, and its time."""

from __future__ import annotations

from prometheus_client import generate_latest

from coordinator.metrics import Metrics
from coordinator.pool.prefix_pull import PullOutcome


def test_pull_families_appear_at_the_first_pull_and_count_each():
    metrics = Metrics("m")
    assert "kv_peer_pull" not in generate_latest(metrics.registry).decode()
    metrics.record_pull(PullOutcome("decode", 3, 3, 3 << 20, 0.004))
    metrics.record_pull(PullOutcome("prefill", 5, 0, 0, 0.02, "holds none of those blocks"))
    text = generate_latest(metrics.registry).decode()
    assert 'kv_peer_pulls_total{model_name="m",outcome="ok",source_role="decode"} 1.0' in text
    assert 'kv_peer_pulls_total{model_name="m",outcome="failed",source_role="prefill"} 1.0' in text
    assert 'kv_peer_pull_blocks_total{model_name="m"} 3.0' in text
    assert 'kv_peer_pull_seconds_count{model_name="m"} 2.0' in text
