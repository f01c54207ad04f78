"""``python -m benchmarks.serving.memory`` at toy size: pdserve (single_node, the tiny model)
started, answering, and its process tree measured. llama-server's side needs a built
llama-server and a GGUF model; the tiny model has none, so here it is left out
(``--no-llama-server``) and covered by the llama.cpp benchmarks' own tests."""

from __future__ import annotations

import pytest

from benchmarks.report import render_memory
from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_memory_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--modes", "single_node", "--requests", "2"]
    argv += ["--settle-s", "0", "--no-llama-server", "--embedding-model", ""]
    result = run_benchmark("memory", tmp_path / "memory.json", *argv)
    assert result["_meta"]["slots"] == 32 and result["_meta"]["gguf_mib"] is None
    side = result["single_node"]
    assert side["total"]["rss_mib"] > 0 and side["given"]["maxBatchSize"] == 32
    assert "failed_requests" not in side and "llama_server" not in result
    assert "single_node" in render_memory(result)
