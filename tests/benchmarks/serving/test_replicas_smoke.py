"""``python -m benchmarks.serving.replicas`` at toy size: the shared pool (its own tiny model)
and two coordinators, one draw at one rate for a second (both sides on the same arrivals), the
shared-prefix chat, and one kill: the killed coordinator's requests were in flight, and every
worker dropped them (their lease lapses: seconds)."""

from __future__ import annotations

import pytest

from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_replicas_toy_run(tmp_path):
    argv = ["--draw-set", "tuning", "--draws", "1", "--rates", "10", "--seconds", "1"]
    argv += ["--users", "2", "--turns", "2", "--kills", "1"]
    result = run_benchmark("replicas", tmp_path / "replicas.json", *argv, timeout_s=400)
    assert result["meta"]["commit"] == result["_meta"]["commit"]  # the report reads "meta"
    assert result["seeds"] == [0]
    for side in ("one", "two"):
        (row,) = result["short_completions"][side]["rates"]
        assert row["rate"] == 10 and row["requests"] > 0 and row["failed"] == 0
        chat = result["prefix_chat"][side]
        assert chat["requests"] == 4 and chat["failed"] == 0
    one, two = (result["short_completions"][side]["rates"][0] for side in ("one", "two"))
    assert one["requests"] == two["requests"]  # the same arrival times
    (kill,) = result["kill"]["runs"]
    assert kill["held_at_kill"] > 0 and kill["freed_s"] is not None
    assert kill["survivor_failed"] == 0 and kill["blocks_in_use_after"] == 0
    assert "failed_requests" not in result
