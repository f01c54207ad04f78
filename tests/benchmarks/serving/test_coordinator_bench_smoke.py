"""``python -m benchmarks.serving.coordinator`` at toy size on the tiny model: one pd_separate
cluster, streams straight and through the HTTP app, two rounds (the first dropped), no embedding
model."""

from __future__ import annotations

import pytest

from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_coordinator_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--tokens", "4", "--prompt-tokens", "8"]
    argv += ["--concurrency", "2", "--rounds", "2", "--embedding-model", ""]
    result = run_benchmark("coordinator", tmp_path / "coordinator.json", *argv)
    assert result["_meta"]["rounds"] == 2 and result["_meta"]["model"] == str(tiny_model_dir)
    figures = result["2"]
    for path in ("direct", "http"):
        assert figures[path]["tokens"]["median"] == 2 * 4
        assert figures[path]["tokens_per_s"]["median"] > 0
    assert len(figures["added_tpot"]["rounds"]) == 1
    assert "embeddings" not in result
