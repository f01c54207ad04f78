"""``python -m benchmarks.serving.burst`` at toy size on the tiny model: a burst the pool serves
whole, every request accounted for, no lease lapsed, every block free after."""

from __future__ import annotations

import pytest

from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_burst_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--requests", "6", "--kv-cache-mb", "1"]
    argv += ["--schedule-timeout-s", "30", "--new-tokens", "2", "--logs", str(tmp_path)]
    result = run_benchmark("burst", tmp_path / "burst.json", *argv)
    (run,) = result["bursts"]
    assert run["requests"] == 6 and run["outcomes"] == {"200": 6}
    assert run["served_per_s"] > 0 and run["served_s_p50"] is not None
    assert run["refused_s_p50"] is None and run["leases_expired"] == 0
    assert run["blocks_in_use_after"] == 0
