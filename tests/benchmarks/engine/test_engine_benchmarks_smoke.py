"""The engine benchmarks' entry points at toy size on the bundled model: the code path a real run
takes (paired rounds, result file with provenance), in seconds."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import decode_step, vs_transformers

pytestmark = pytest.mark.slow


def _run(main, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr("sys.argv", ["benchmark", *argv])
    main()


def test_vs_transformers_toy_run(tmp_path, monkeypatch):
    out = tmp_path / "engine.json"
    argv = ["--scratch", "--out", str(out), "--rounds", "1", "--new-tokens", "2"]
    _run(vs_transformers.main, monkeypatch, *argv, "--batch", "2", "--prefill-tokens", "8")
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["_meta"]["rounds"] == 1
    assert set(result) == {"_meta", "single_stream", "batch2", "prefill8"}
    for key in ("single_stream", "batch2", "prefill8"):
        ratio = result[key]["ratio"]
        assert ratio["median"] > 0 and ratio["low"] <= ratio["median"] <= ratio["high"]
        assert result[key]["prefix_cache_hit_tokens"] == 0


def test_decode_step_toy_run(tmp_path, monkeypatch):
    out = tmp_path / "decode_step.json"
    _run(decode_step.main, monkeypatch, "--scratch", "--out", str(out), "--tokens", "3")
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["_meta"]["rounds"] == 5
    assert result["fused"]["step"] > 0 and result["op_by_op"]["step"] > 0
    assert len(result["_fused_speedup"]["rounds"]) == 5
