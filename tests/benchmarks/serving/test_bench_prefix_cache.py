"""The prefix-cache benchmark's pure parts: the multi-turn workload's shape, the hit rate a
workload allows, counters and usage parsing, and the on / off table (no server); and a
``--tenants`` run end to end against in-process predict apps of the tiny model."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any

import pytest

from benchmarks.harness.client import Target
from benchmarks.harness.results import SCRATCH, ResultFile
from benchmarks.serving import prefix_cache as bench_prefix_cache
from benchmarks.serving.metrics import SLO
from benchmarks.serving.prefix_cache import (
    Column,
    Tokenizer,
    bytes_per_handoff,
    counter_delta,
    metrics_hit_rate,
    parse_prefix_counters,
    ratios,
    table,
    tenant_keys,
    user_target,
)
from benchmarks.serving.prefix_chat import (
    SentPrompt,
    allowed_cached_tokens,
    cache_figures,
    hit_rate,
    make_conversations,
    system_prompt,
)
from tests.support.tenant_cluster import served


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


# ---- --tenants: the cost of tenant isolation -------------------------------------------------


class ChatChars:
    """A tokenizer for the tiny model: a token per character (within its vocabulary); chat
    renders every message, role first, so turns extend their conversation's tokens."""

    all_special_ids = [0]

    def encode(self, text: str, **_: Any) -> list[int]:
        return [3 + ord(c) % 500 for c in text]

    def apply_chat_template(self, messages: list[dict], **_: Any) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


def test_tenants_option_names_its_results_file():
    tenants = bench_prefix_cache.parse_args(["--tenants", "6"])
    assert tenants.out is None and tenants.result_name == "prefix_cache_tenants"
    scratch = ResultFile.start(bench_prefix_cache.parse_args(["--tenants", "6", "--scratch"]))
    assert scratch.path == SCRATCH / "prefix_cache_tenants.json"
    on_off = bench_prefix_cache.parse_args([])
    assert on_off.tenants == 0 and on_off.result_name == "prefix_cache"


def test_user_target_cycles_the_tenants_keys():
    target = Target("http://x", "chat")
    keys = tenant_keys(2)
    heads = [dict(user_target(target, keys, u).headers)["authorization"] for u in range(3)]
    assert heads == [f"Bearer {keys[0]}", f"Bearer {keys[1]}", f"Bearer {keys[0]}"]
    assert user_target(target, (), 5) is target


def test_a_tenants_run_writes_one_tenant_against_six(tiny_model_dir, tmp_path, monkeypatch):
    """The whole script but pdserve's start-up: each column an in-process predict app behind
    the six keys, tenant isolation on (tests.coordinator.test_tenant_isolation)."""
    started = []

    @contextmanager
    def column(args, workdir, caching, tenants=0):
        started.append((caching, tenants))
        keys = tenant_keys(args.tenants)
        with served(tiny_model_dir, 1, True, keys, ChatChars()) as (url, _):
            yield Column(f"{tenants} tenants", Target(url, "chat"), keys=tenant_keys(tenants))

    chars = ChatChars()
    tokenizer = Tokenizer(lambda m: chars.apply_chat_template(m), chars.encode)
    monkeypatch.setattr(bench_prefix_cache, "pdserve_column", column)
    monkeypatch.setattr(bench_prefix_cache, "load_chat_tokenizer", lambda name: tokenizer)
    out = tmp_path / "tenants.json"
    argv = ["--tenants", "6", "--users", "6", "--turns", "2", "--system-tokens", "40"]
    argv += ["--user-words", "2", "--max-tokens", "2", "--concurrency", "1", "--repeats", "1"]
    argv += ["--block-size", "4", "--out", str(out)]
    assert bench_prefix_cache.main(argv) == 0
    assert started == [(True, 1), (True, 6)]
    report = json.loads(out.read_text())
    one, six = report["columns"]
    assert (one["tenants"], six["tenants"]) == (1, 6)
    for each in (one, six):  # every request answered (the tiny model's text may be empty)
        assert each["summary"]["num_requests"] == len(each["requests"]) == 12
        assert [r["error"] for r in each["requests"]] == [None] * 12
    # one tenant: users after the first find the shared system prompt; six: each its own only
    # (user 0 shares its key with the warm-up, whose system prompt opens the same way)
    first_turns = [
        [r["cached_tokens"] for r in c["requests"] if r["turn"] == 0] for c in (one, six)
    ]
    assert min(first_turns[0][1:]) >= 40
    assert first_turns[1][1:] == [0] * 5
    assert one["summary"]["hit_rate_usage"] > six["summary"]["hit_rate_usage"] > 0
    ratios = report["ratios_tenants_over_one"]
    assert ratios["request_throughput"]["ratio"] is not None
    assert "goal" not in ratios["request_throughput"]  # a cost, not a goal
    assert "| | 1 tenants | 6 tenants | 6 / 1 tenant |" in out.with_suffix(".md").read_text()
