"""``python -m benchmarks.serving.stream_path`` at toy size on the tiny model: single_node's
cluster reached over Ray and pdserve's stream, one kept round each."""

from __future__ import annotations

import pytest

from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_stream_path_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--modes", "single_node", "--rounds", "1"]
    # enough tokens that several come as text of their own: the tiny model's random tokens are
    # often bytes of a character, which the stream holds until the character is whole
    argv += ["--new-tokens", "32"]
    result = run_benchmark("stream_path", tmp_path / "stream_path.json", *argv)
    mode = result["modes"]["single_node"]
    assert mode["cluster"]["engine_gap_ms"]["rounds"][0] > 0
    assert mode["served"]["gap_ms"]["rounds"][0] > 0
    assert mode["served_over_engine"]["median"] > 0 and result["prompt_tokens"] == 100
