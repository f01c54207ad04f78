"""``python -m benchmarks.engine.int8_rows`` at toy size: every case on both sides with its
speed-up and verdict, and the module left on float32 activations after."""

from __future__ import annotations

import json

import pytest

from benchmarks import report
from benchmarks.engine import int8_rows
from engine.kernels.quantized import quantized_kernels


def test_a_toy_run_writes_every_case_with_its_verdict(tmp_path, monkeypatch):
    module = quantized_kernels()
    if module is None:
        pytest.skip("needs the native kernels")
    monkeypatch.setattr(int8_rows, "CASES", (("q4_k", 16, 256), ("q8_0", 16, 64)))
    out = tmp_path / "int8_rows.json"
    int8_rows.main(["--scratch", "--out", str(out), "--rounds", "2", "--repeats", "4"])
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["goal"] == ">= 1x"
    assert result["int8_path"] in ("vnni", "avx2", "scalar")
    names = [f"{k} {n}x{w} M={rows}" for k, n, w in int8_rows.CASES for rows in int8_rows.ROWS]
    assert [key for key in result if key in names] == names
    for name in names:
        case = result[name]
        assert len(case["int8_speedup"]["rounds"]) == 2 and case["verdict"] == "undecided"
        assert case["int8_us"]["median"] > 0 and case["float32_us"]["median"] > 0
    assert module.activation_dtype() == "float32"
    assert "| q4_k 16x256 M=1 |" in report.render_int8_rows(result)
