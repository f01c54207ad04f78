"""``python -m benchmarks.engine.decode_limit``: the bytes a one-stream decode step reads, read
from the file (the embedding table counted only as a tied LM head), a copy bandwidth in bytes a
second, and a toy run against a stand-in ``llama-bench`` that writes and renders each engine's
share of the limit."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGUFWriter

from benchmarks import report
from benchmarks.engine import decode_limit
from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from engine.kernels.isa import activation_dtype
from tests.benchmarks.llamacpp.test_bench_vs_llamacpp import BENCH_ROW, _tool


def _gguf(path, tensors: dict[str, tuple[int, ...]]):
    writer = GGUFWriter(path, "llama")
    for name, dims in tensors.items():
        writer.add_tensor(name, np.zeros(dims, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bytes_per_token_count_every_matrix_and_a_tied_embedding_once(tmp_path):
    layer = {"token_embd.weight": (8, 4), "blk.0.attn_q.weight": (4, 4), "output_norm.weight": (4,)}
    tied = _gguf(tmp_path / "tied.gguf", layer)
    assert decode_limit.bytes_per_token(tied) == 4 * (8 * 4 + 4 * 4)  # the table is the LM head
    untied = _gguf(tmp_path / "untied.gguf", {**layer, "output.weight": (6, 4)})
    assert decode_limit.bytes_per_token(untied) == 4 * (6 * 4 + 4 * 4)  # one embedding row: left


def test_bandwidths_are_bytes_a_second():
    assert 1e8 < decode_limit.copy_bandwidth(8, repeats=2) < 1e12
    assert 1e8 < decode_limit.read_bandwidth(8, repeats=2) < 1e12


def test_a_toy_run_writes_and_renders_both_shares(tmp_path):
    _tool(tmp_path, "llama-bench", json.dumps([BENCH_ROW]))
    gguf = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    out = tmp_path / "decode_limit.json"
    argv = ["--scratch", "--out", str(out), "--gguf", str(gguf), "--llama-cpp-dir", str(tmp_path)]
    decode_limit.main([*argv, "--rounds", "2", "--tokens", "4", "--buffer-mb", "8"])
    result = json.loads(out.read_text())
    assert result["_meta"]["complete"] and result["bytes_per_token"] > 0
    for kind in ("read", "copy"):
        assert result["limit_tokens_per_s"][kind]["median"] > 0
        assert len(result["gb_per_s"][kind]["rounds"]) == 2
    engines = result["engines"]
    assert list(engines) == ["pdserve float32", "pdserve int8", "llama.cpp"]
    assert engines["llama.cpp"]["tokens_per_s"]["median"] == BENCH_ROW["avg_ts"]
    for entry in engines.values():
        assert set(entry["share_of_limit"]) == {"read", "copy"}
        assert all(s["median"] > 0 for s in entry["share_of_limit"].values())
    assert activation_dtype() == "float32"  # the process's choice given back
    assert (tmp_path / "llama-bench.args").read_text().split()[-8:-6] == ["-p", "0"]
    table = report.RENDERERS["decode_limit"](result)
    assert "| pdserve int8 |" in table and "| llama.cpp | 151.50" in table
