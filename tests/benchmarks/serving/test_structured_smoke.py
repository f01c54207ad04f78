"""``python -m benchmarks.serving.structured`` at toy size on the tiny model: the compile
measure, pdserve started as a fixed split, constrained against unconstrained streams, the result
file the report renders."""

from __future__ import annotations

import pytest

from benchmarks.report import render_structured
from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_structured_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--streams", "1", "2", "--repeats", "1"]
    argv += ["--per-client", "1", "--digits", "2", "--text-fields", "1", "--compile-draws", "2"]
    result = run_benchmark("structured", tmp_path / "structured.json", *argv)
    assert result["meta"]["commit"] == result["_meta"]["commit"]  # the report reads "meta"
    assert result["deploy_mode"] == "pd_separate"
    compiled = result["compile"]
    assert len(compiled["cold_ms"]["rounds"]) == 2 and compiled["cold_ms"]["min"] > 0
    serving = result["serving"]
    assert set(serving["streams"]) == {"1", "2"}
    for row in serving["streams"].values():
        assert len(row["ratio"]["rounds"]) == 1 and row["tpot_ms_constrained"]["median"] > 0
    assert serving["outputs"] == 3  # 1 + 2 constrained requests
    assert "failed_requests" not in result
    assert "| 1 |" in render_structured(result)
