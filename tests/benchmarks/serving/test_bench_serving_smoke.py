"""A short run of benchmarks/serving/sweep.py against a running pdserve: the JSON is complete
and agrees with what the server counted."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from benchmarks.serving import sweep as bench_serving
from benchmarks.serving.workload import WorkItem, write_dataset
from tests.support.coordinator_servers import MAX_ITER

pytestmark = pytest.mark.ray


def generated_tokens(server) -> float:
    text = httpx.get(server.url("external_port", "/metrics")).text
    return sum(float(v) for v in re.findall(r"^generation_tokens_total\{.*\} (\S+)$", text, re.M))


def test_smoke_run_is_complete_and_consistent(servers, tmp_path, tiny_model_dir):
    server = servers["zmq"]
    items = [WorkItem(f"The quick brown fox number {i}", 3 + i % 4, "chat") for i in range(6)]
    assert max(i.output_tokens for i in items) <= MAX_ITER
    dataset, out = tmp_path / "mix.jsonl", tmp_path / "serving.json"
    write_dataset(items, dataset)
    before = generated_tokens(server)
    args = ["--url", server.url("predict_port", ""), "--dataset", str(dataset)]
    args += ["--request-rates", "5,inf", "--num-requests", "6", "--no-progress"]
    args += ["--tokenizer", str(tiny_model_dir), "--out", str(out)]
    assert bench_serving.main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2
    total = 0
    for run in result["runs"]:
        requests, summary = run["requests"], run["summary"]
        assert len(requests) == summary["num_requests"] == 6
        assert summary["num_failed"] == 0
        for request, item in zip(requests, items, strict=True):
            assert request["output_tokens"] == item.output_tokens  # ignore_eos: exactly asked
            assert len(request["gaps_s"]) == request["output_tokens"] - 1
            assert 0 < request["ttft_s"] <= request["e2e_s"]
        assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in requests)
        assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
        total += summary["total_output_tokens"]
    assert generated_tokens(server) - before == total  # what the server says it generated
    assert out.with_suffix(".cdf.png").stat().st_size > 0
    assert out.with_suffix(".goodput.png").stat().st_size > 0
