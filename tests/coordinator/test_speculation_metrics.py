"""Speculative decoding's Prometheus families: absent while no worker speculates, then each
worker's counters and its acceptance histogram, fed from the figures its loads carry."""

from __future__ import annotations

from prometheus_client import generate_latest

from coordinator.metrics import Metrics
from engine.outputs import EngineStats
from workers.contracts import WorkerLoad


def _load(**stats: object) -> WorkerLoad:
    return WorkerLoad("decode", 0, 42, EngineStats(**stats))  # type: ignore[arg-type]


def test_the_families_appear_once_a_worker_speculates():
    metrics = Metrics("m")
    metrics.record_loads([_load()])
    assert b"speculative" not in generate_latest(metrics.registry)
    figures = {"speculative_checks": 3, "speculative_drafted": 10, "speculative_accepted": 6}
    metrics.record_loads([_load(**figures, speculative_accepted_histogram=(1, 0, 2))])
    metrics.record_loads([_load(**figures, speculative_accepted_histogram=(1, 0, 2))])  # again
    text = generate_latest(metrics.registry).decode()
    labels = 'instance="0",model_name="m",role="decode"'
    assert f"speculative_checks_total{{{labels}}} 3.0" in text
    assert f"speculative_drafted_tokens_total{{{labels}}} 10.0" in text
    assert f"speculative_accepted_tokens_total{{{labels}}} 6.0" in text
    assert f'speculative_checks_by_accepted_total{{accepted="2",{labels}}} 2.0' in text
