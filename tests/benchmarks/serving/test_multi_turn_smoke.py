"""``python -m benchmarks.serving.multi_turn`` at toy size on the tiny model: tiers off against
both tiers with a cache that holds one conversation, a round kept, and the worker killed: its
next turns come from the tiers the restarted worker reads back."""

from __future__ import annotations

import pytest

from benchmarks.serving.multi_turn import Workload
from tests.benchmarks.serving.serving_toy import run_benchmark

pytestmark = pytest.mark.ray


def test_multi_turn_toy_run(tmp_path, tiny_model_dir):
    argv = ["--model", str(tiny_model_dir), "--sides", "tiers_off,tiers_disk"]
    argv += ["--conversations", "3", "--rounds", "1", "--answer-tokens", "2", "--kv-mb", "1"]
    argv += ["--host-mb", "8", "--disk-mb", "8", "--workdir", str(tmp_path / "work")]
    argv += ["--passage-chars", "100"]  # the tiny model takes 1024 tokens
    result = run_benchmark("multi_turn", tmp_path / "multi_turn.json", *argv, timeout_s=400)
    off, disk = result["sides"]["tiers_off"], result["sides"]["tiers_disk"]
    assert off["ttft_p50_s"]["median"] > 0 and disk["ttft_p50_s"]["median"] > 0
    assert disk["reuse"]["median"] >= 0.85
    restart = result["restart"]
    assert restart["killed_pids"] and restart["turns"] == 3
    assert restart["history_cached"]["min"] >= 0.9 and restart["verdict"] == "met"


def test_every_side_is_sent_the_same_growing_conversations(tiny_model_dir):
    from engine.model.model_files import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    first, second = Workload(tokenizer, 3, 5), Workload(tokenizer, 3, 5)
    rounds = [first.round_prompts() for _ in range(3)]
    assert rounds == [second.round_prompts() for _ in range(3)]
    assert all(reusable == 0 for _, reusable in rounds[0])
    for earlier, later in zip(rounds, rounds[1:], strict=False):
        longest = max(len(p) for p, _ in earlier)
        assert (
            all(reusable > 0 for _, reusable in later) and max(len(p) for p, _ in later) > longest
        )
