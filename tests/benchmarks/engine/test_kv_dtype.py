"""``python -m benchmarks.engine.kv_dtype``: its cases parsed, its decode timing counts only
decode steps of requests that ran to the end, and a toy run on a random GGUF writes and renders
every side against float32."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import report
from benchmarks.engine import kv_dtype
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from tests.conftest import make_engine
from tests.support.block_checks import num_used


def test_a_case_is_two_positive_counts():
    assert kv_dtype.parse_case("32:512") == (32, 512)
    for bad in ("32", "0:5", "a:b", "3:-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="streams:context"):
            kv_dtype.parse_case(bad)


def test_decode_timing_runs_every_request_to_its_end_and_frees_it(tiny_loaded):
    engine = make_engine(tiny_loaded, kv_cache_dtype="float16")
    ms = kv_dtype.decode_ms_per_step(engine, [[5] * 9, [6] * 3], tokens=4)
    assert ms > 0 and not engine.has_work() and num_used(engine.blocks) == 0


def test_a_toy_run_writes_each_16_bit_side_against_float32(tmp_path):
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "kv_dtype.json"
    kv_dtype.main(["--scratch", "--out", str(out), "--gguf", str(gguf), "--case", "2:16",
                   "--case", "1:40", "--tokens", "3", "--rounds", "2"])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and list(result["cases"]) == ["2:16", "1:40"]
    per_token = result["kv_bytes_per_token"]
    assert per_token["float32"] == 2 * per_token["float16"] == 2 * per_token["bfloat16"]
    for entry in result["cases"].values():
        assert set(entry["ms_per_step"]) == set(kv_dtype.SIDES)
        for side in ("float16", "bfloat16"):
            assert len(entry[f"{side}_speedup"]["rounds"]) == 2
            assert entry[f"{side}_speedup"]["verdict"] == "undecided"  # 2 rounds decide nothing
    table = report.RENDERERS["kv_dtype"](result)
    assert "| 1:40 |" in table and table.count("undecided") == 4
