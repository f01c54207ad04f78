"""``python -m benchmarks.serving.served_stream`` at toy size on the tiny model: single_node's
engine probe (its step and its closed loop) and one OpenAI stream, one kept round, no
llama-server."""

from __future__ import annotations

import pytest

from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_served_stream_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--modes", "single_node", "--doors", "openai"]
    argv += ["--concurrency", "1", "--rounds", "1", "--warmup", "0", "--no-llama-server"]
    argv += ["--new-tokens", "6", "--probe-tokens", "4", "--lead-s", "0.2", "--window-s", "1"]
    result = run_benchmark("served_stream", tmp_path / "served_stream.json", *argv)
    served = result["sides"]["served/single_node/openai/1"]
    assert served["tokens_per_s"]["median"] > 0 and served["failed"]["median"] == 0
    assert served["cpu_ms_per_token:coordinator"]["median"] > 0
    assert served["cpu_ms_per_token:ray::ColocatedWorker"]["median"] > 0
    assert result["sides"]["engine/single_node/1"]["step_ms"]["median"] > 0
    assert result["sides"]["engine_loop/single_node/1"]["tokens_per_s"]["median"] > 0
    goals = {row["goal"] for row in result["goals"]}
    assert goals == {
        "tpot_over_engine_step",
        "coordinator_cpu_ms_per_token",
        "rate_over_engine",
        "rate_over_engine_loop",  # a figure with no goal
    }
    assert result["given"]["single_node"]["engine_probe"]["threads"] >= 1
