"""serving_phases: the queue, prefill and transfer histograms of pdserve's real Prometheus text,
differenced between two scrapes into per-role means, and the table made of them."""

from __future__ import annotations

import pytest

from benchmarks.serving.modes_report import phases_table
from benchmarks.serving.phases import parse, phase_means
from coordinator.metrics import Metrics


def test_the_means_are_of_what_happened_between_the_two_scrapes():
    metrics = Metrics("m")
    metrics.record_prefill("prefill", 5.0, 9.0)  # before the rate: left out
    before = parse(metrics.exposition().decode())
    metrics.record_prefill("prefill", 0.2, 1.4)
    metrics.record_prefill("prefill", 0.4, 1.6)
    metrics.record_prefill("decode", 0.01, 0.05)
    metrics.record_handoff(4096, 0.02, "frames")
    phases = phase_means(before, parse(metrics.exposition().decode()))
    assert set(phases) == {"prefill", "decode", "transfer"}  # no colocated prompt: no row
    assert phases["prefill"]["prompts"] == 2
    assert phases["prefill"]["queue_s"] == pytest.approx(0.3)
    assert phases["prefill"]["prefill_s"] == pytest.approx(1.5)
    decode = {"prompts": 1, "queue_s": pytest.approx(0.01), "prefill_s": pytest.approx(0.05)}
    assert phases["decode"] == decode
    assert phases["transfer"] == {"handoffs": 1, "seconds": pytest.approx(0.02)}
    assert phase_means(before, before) == {}


def test_the_table_has_a_row_per_role_with_the_handoffs_on_the_prefill_one():
    phases = {
        "prefill": {"prompts": 2, "queue_s": 0.3, "prefill_s": 1.5},
        "decode": {"prompts": 3, "queue_s": 0.01, "prefill_s": 0.05},
        "transfer": {"handoffs": 2, "seconds": 0.02},
    }
    results = {
        "pd": {"runs": [{"request_rate": 1.0, "phases": phases}]},
        "llama_server": {"runs": [{"request_rate": 1.0}]},  # no metrics of its own: no rows
    }
    lines = phases_table(results, 1.0).splitlines()
    assert lines[2:] == [
        "| pd: prefill | 2 | 300 | 1500 | 2 | 20 |",
        "| pd: decode | 3 | 10 | 50 | - | - |",
    ]
