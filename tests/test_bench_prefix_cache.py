"""The prefix-cache benchmark's pure parts: the multi-turn workload's shape, the hit rate a
workload allows, counters and usage parsing, and the on / off table. No server."""

from __future__ import annotations

import pytest

from benchmarks.bench_prefix_cache import (
    bytes_per_handoff,
    cached_tokens_of,
    counter_delta,
    metrics_hit_rate,
    parse_prefix_counters,
    ratios,
    table,
)
from benchmarks.prefix_chat_workload import (
    SentPrompt,
    allowed_cached_tokens,
    cache_figures,
    hit_rate,
    make_conversations,
    system_prompt,
)
from benchmarks.serving_metrics import SLO


def words(text: str) -> list[int]:
    """A stand-in tokenizer: a token per word."""
    return [hash(word) % 1000 for word in text.split()]


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """A stand-in chat template: a marker per role, the content's tokens, then the marker that
    opens the answer."""
    ids = []
    for message in messages:
        ids += [-len(message["role"]), *words(message["content"])]
    return [*ids, -len("assistant")]


def answered(users: int = 3, turns: int = 4):
    conversations = make_conversations(users, turns, system_prompt(50, words, seed=1), seed=1)
    for user, conversation in enumerate(conversations):
        for turn in range(turns):
            conversation.messages(turn)
            conversation.add_answer(turn, f"answer {turn} to user {user}")
    return conversations


def test_system_prompt_is_seeded_and_sized():
    assert len(words(system_prompt(200, words, seed=3))) == 200
    assert system_prompt(200, words, seed=3) == system_prompt(200, words, seed=3)
    assert system_prompt(200, words, seed=3) != system_prompt(200, words, seed=4)


def test_each_turn_extends_the_last_turn_and_its_answer():
    conversations = answered()
    system = conversations[0].system
    for conversation in conversations:
        for turn in range(1, conversation.num_turns):
            before, now = conversation.messages(turn - 1), conversation.messages(turn)
            assert now[0] == {"role": "system", "content": system}
            assert now[: len(before)] == before
            assert now[len(before)] == {
                "role": "assistant",
                "content": conversation.answers[turn - 1],
            }
            assert len(now) == len(before) + 2
            ids_before, ids_now = chat_ids(before), chat_ids(now)
            assert ids_now[: len(ids_before)] == ids_before  # token by token too
    assert len({c.user_messages[0] for c in conversations}) == len(conversations)


def test_a_turn_needs_the_answers_before_it():
    conversation = make_conversations(1, 3, "system")[0]
    with pytest.raises(ValueError):
        conversation.messages(1)
    conversation.add_answer(0, "first")
    with pytest.raises(ValueError):
        conversation.add_answer(2, "third")
    assert conversation.messages(1)[-2:] == [
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": conversation.user_messages[1]},
    ]


def sent(ids, sent_at, answer=(), ended_at=float("inf")) -> SentPrompt:
    return SentPrompt(tuple(ids), sent_at, tuple(answer), ended_at)


def test_allowed_cached_tokens_by_hand():
    base = list(range(10))
    prompts = [
        sent(base, 0.0),  # first: nothing cached
        sent(base[:8], 0.0),  # sent at the same time: nothing either
        sent([*base, 10, 11, 12], 1.0),  # 10 ids covered: 2 full blocks of 4
        sent(base[:8], 2.0),  # 8 covered, but its last token is computed: 1 block
        sent([0, 1, 2, 99, 4, 5, 6, 7, 8], 2.0),  # its first block differs
        sent([*base, 10, 11, 12, 13, 14], 3.0),  # the third covered 13: 3 blocks
    ]
    assert allowed_cached_tokens(prompts, 4) == [0, 0, 8, 4, 0, 12]
    assert allowed_cached_tokens(prompts, 100) == [0] * 6


def test_answers_cover_once_they_have_ended():
    prompt = list(range(6))
    first = sent(prompt, 0.0, answer=[6, 7], ended_at=1.0)
    second = sent([*prompt, 6, 7, 8, 9], 2.0)
    assert allowed_cached_tokens([first, second], 2, with_answers=True) == [0, 8]
    assert allowed_cached_tokens([first, second], 2) == [0, 6]  # prompts only
    early = sent([*prompt, 6, 7, 8, 9], 0.5)  # sent before the answer ended
    assert allowed_cached_tokens([first, early], 2, with_answers=True) == [0, 6]


def test_hit_rate_skips_requests_without_a_count():
    assert hit_rate([10, None, 30], [100, 100, 100]) == pytest.approx(0.2)
    assert hit_rate([None], [100]) is None
    assert hit_rate([], []) is None


def test_prefix_counters_and_usage():
    page = (
        "# HELP prefix_cache_hits_total tokens\n"
        'prefix_cache_hits_total{model_name="m",role="prefill",instance="0"} 300.0\n'
        'prefix_cache_hits_total{model_name="m",role="decode",instance="0"} 50.0\n'
        'prefix_cache_queries_total{model_name="m",role="prefill",instance="0"} 1000.0\n'
        'prefix_cache_queries_total{model_name="m",role="decode",instance="0"} 100.0\n'
        'prefix_cache_hits_created{model_name="m",role="prefill",instance="0"} 1.7e9\n'
    )
    counters = parse_prefix_counters(page)
    assert counters["all"] == {"queries": 1100.0, "hits": 350.0}
    assert metrics_hit_rate(counters) == pytest.approx(0.3)  # the prefill side's
    assert parse_prefix_counters("request_success_total 3\n") is None
    assert cached_tokens_of({"usage": {"prompt_tokens_details": {"cached_tokens": 7}}}) == 7
    assert cached_tokens_of({"timings": {"cache_n": 5}}) == 5
    assert cached_tokens_of({"usage": {"prompt_tokens": 9}}) is None


def test_bytes_per_handoff_from_the_kv_counters():
    before = parse_prefix_counters(
        'kv_transfer_bytes_total{model_name="m"} 1000.0\n'
        'kv_transfers_total{model_name="m",path="shared_memory"} 1.0\n'
    )
    after = parse_prefix_counters(
        'kv_transfer_bytes_total{model_name="m"} 4000.0\n'
        'kv_transfers_total{model_name="m",path="shared_memory"} 3.0\n'
        'kv_transfers_total{model_name="m",path="frames"} 1.0\n'
    )
    assert bytes_per_handoff(counter_delta(before, after)) == pytest.approx(1000.0)
    assert bytes_per_handoff(before) == pytest.approx(1000.0)
    assert bytes_per_handoff(None) is None and metrics_hit_rate(before) is None


def column(label, p50s, rates, hit) -> dict:
    """A column's results with per-repeat TTFT p50s and request rates (pooled: their means)."""

    def summary(p50, rate):
        return {
            "ttft_s": {"p50": p50, "p99": 2 * p50},
            "e2e_s": {"p50": p50 + 1},
            "ttft_quartiles_s": [p50 * 0.8, p50 * 2],
            "request_throughput": rate,
            "slo_attainment": 1.0,
            "hit_rate_usage": hit,
            "hit_rate_metrics": hit,
            "allowed_hit_rate": 0.8,
            "num_succeeded": 10,
            "num_requests": 10,
        }

    repeats = [summary(p, r) for p, r in zip(p50s, rates, strict=True)]
    pooled = summary(sum(p50s) / len(p50s), sum(rates) / len(rates))
    return {"label": label, "summary": pooled, "repeats": repeats}


def test_ratios_and_table():
    on = column("caching on", [0.2, 0.3], [3.0, 2.0], 0.75)
    off = column("caching off", [1.0, 1.0], [1.0, 1.0], 0.0)
    result = ratios(on, off)
    assert result["ttft_p50"]["ratio"] == pytest.approx(0.25)
    assert (result["ttft_p50"]["min"], result["ttft_p50"]["max"]) == pytest.approx((0.2, 0.3))
    assert result["ttft_p50"]["met"] is True
    assert result["request_throughput"]["ratio"] == pytest.approx(2.5)
    assert result["request_throughput"]["met"] is True
    assert ratios(off, on)["request_throughput"]["met"] is False
    text = table([on, off], result, SLO(3.0, 0.15))
    lines = text.splitlines()
    assert lines[0] == "| | caching on | caching off | on / off |"
    assert all(line.count("|") == 5 for line in lines)
    p50_row = next(line for line in lines if line.startswith("| TTFT p50"))
    assert "0.25 [0.20-0.50]" in p50_row  # caching on: p50 [IQR]
    assert "0.25 [0.20-0.30] (goal <= 0.3: met)" in p50_row
    assert "| hit rate: usage | 75% | 0% |  |" in text
    assert "TPOT <= 150 ms" in text
    assert "on / off" not in table([on], None, SLO())


def test_cache_figures_over_successful_requests():
    def row(turn, ttft, cached, allowed, with_answers, ok=True):
        return {
            "ok": ok,
            "turn": turn,
            "ttft_s": ttft,
            "prompt_tokens": 100,
            "num_prompt_ids": 100,
            "usage_prompt_tokens": 100,
            "cached_tokens": cached,
            "allowed_cached_tokens": allowed,
            "allowed_cached_tokens_with_answers": with_answers,
        }

    rows = [row(0, 2.0, 0, 0, 0), row(1, 0.5, 50, 60, 80), row(1, 9.0, 99, 99, 99, ok=False)]
    figures = cache_figures(rows, with_answers=False)
    assert figures["hit_rate_usage"] == pytest.approx(0.25)
    assert figures["allowed_hit_rate"] == pytest.approx(0.3)
    assert cache_figures(rows, with_answers=True)["allowed_hit_rate"] == pytest.approx(0.4)
    assert figures["ttft_p50_by_turn_s"] == [2.0, 0.5]
    assert figures["prompt_token_mismatches"] == 0
