"""``python -m benchmarks.serving.burst`` at toy size on the tiny model: two burst sizes in a
paired round, each served whole, every request accounted for, the CPU it cost each side, no lease
lapsed, every block free after, and the ratio of their throughputs with its verdict."""

from __future__ import annotations

import pytest

from benchmarks.serving.burst_report import render
from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_burst_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--requests", "3,6", "--kv-cache-mb", "1"]
    argv += ["--schedule-timeout-s", "30", "--new-tokens", "2", "--logs", str(tmp_path)]
    argv += ["--rounds", "1", "--warmup", "0"]
    result = run_benchmark("burst", tmp_path / "burst.json", *argv)
    small, large = result["bursts"]
    assert (small["requests"], large["requests"]) == (3, 6)
    for run, size in ((small, 3), (large, 6)):
        assert run["rounds"] == 1 and len(run["runs"]) == 1
        assert run["outcomes"] == {"200": size}
        assert run["served_per_s"] > 0 and run["served_s_p50"] is not None
        assert run["refused_s_p50"] is None and run["leases_expired"] == 0
        assert run["blocks_in_use_after"] == 0
        assert run["coordinator_cpu_s"] > 0 and run["workers_cpu_s"] > 0  # a burst costs CPU
    ratio = result["throughput_ratio"]
    assert (ratio["ours"], ratio["theirs"]) == ("6", "3")
    expected = large["runs"][0]["served_per_s"] / small["runs"][0]["served_per_s"]
    assert ratio["rounds"] == [pytest.approx(expected, abs=1e-3)]
    assert result["goal"]["verdict"] == "undecided"  # one round decides nothing
    table = render(result, "provenance")
    assert "| 6 | 6 | 0 | 0 | 0 |" in table and "undecided (met in" in table
