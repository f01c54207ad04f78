"""The engine's closed loop of the served workload (benchmarks/engine/closed_loop.py)."""

from __future__ import annotations

from benchmarks.engine.closed_loop import run_closed_loop
from benchmarks.engine.measures import PromptDraw


def test_streams_send_a_new_prompt_when_their_answer_ends(tiny_engine) -> None:
    draw = PromptDraw(3, 200)
    run = run_closed_loop(tiny_engine, draw, streams=4, prompt_tokens=12, new_tokens=8, steps=16)
    # 16 steps of 4 streams: each stream ends an answer at least once in them (8 tokens each)
    assert run.answers >= 4
    assert 4 * 16 // 2 <= run.tokens <= 4 * 16
    assert run.tokens_per_s > 0


def test_nothing_is_left_running_after_a_loop(tiny_engine) -> None:
    run_closed_loop(tiny_engine, PromptDraw(5, 200), streams=3, prompt_tokens=9, new_tokens=6)
    assert not tiny_engine.has_work()
    stats = tiny_engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
