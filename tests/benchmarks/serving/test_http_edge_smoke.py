"""``python -m benchmarks.serving.http_edge`` at toy size: two protocols' servers started,
streams timed for one round, ratios to plain httptools, no attacks (they sleep through the header
timeout: seconds a protocol)."""

from __future__ import annotations

from tests.benchmarks.serving.serving_toy import run_benchmark


def test_http_edge_toy_run(tmp_path):
    argv = ["--protocols", "httptools,guarded", "--rounds", "1", "--tokens", "64"]
    argv += ["--requests-scale", "0.25", "--no-attacks"]  # enough events for a CPU clock tick
    result = run_benchmark("http_edge", tmp_path / "http_edge.json", *argv)
    assert result["meta"]["commit"] == result["_meta"]["commit"]  # the report reads "meta"
    assert result["streams_per_round"] == {"1": 12, "64": 128}
    for protocol in ("httptools", "guarded"):
        for concurrency in ("1", "64"):
            assert result["events_per_s"][protocol][concurrency]["median"] > 0
            assert result["server_cpu_us_per_event"][protocol][concurrency]["rounds"]
    assert result["cpu_ratio_to_httptools"]["httptools"]["1"]["median"] == 1.0
    assert result["attacks"] == {} and "failed_streams" not in result
