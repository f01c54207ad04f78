"""Automatic prefix caching in the engine: reused KV never changes a result, shared blocks are
counted right through abort, preemption and eviction, and a hash collision is caught."""

from __future__ import annotations

import random

import pytest
import torch

import engine.prefix_hash as prefix_hash
from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.block_checks import check_consistent, num_used, ref_count

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.2, seed=3, ignore_eos=True)
SYSTEM = list(range(20, 46))  # 26 tokens: six full blocks of 4, and two over


def _first_logits(engine: LLMEngine, request_id: str, prompt: list[int]) -> torch.Tensor:
    """The logits that sample the first token of ``prompt`` (run to its end)."""
    captured: dict[str, torch.Tensor] = {}
    run = engine.runner.run

    def recording(scheduled, *hooks):
        logits, samplers = run(scheduled, *hooks)
        for row, request in enumerate(samplers):
            captured.setdefault(request.request_id, logits[row].clone())
        return logits, samplers

    engine.runner.run = recording
    try:
        engine.add_request(engine.request(request_id, prompt, GREEDY))
        while request_id in engine.requests:
            engine.step()
    finally:
        engine.runner.run = run
    return captured[request_id]


def _outputs(engine: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return engine.generate(prompts, params)


def _live_refs(engine: LLMEngine) -> list[int]:
    """Reference counts the live requests account for, per block."""
    refs = [0] * engine.blocks.num_blocks
    for request in engine.requests.values():
        for block_id in request.block_ids:
            refs[block_id] += 1
    return refs


def _check(engine: LLMEngine) -> None:
    check_consistent(engine.blocks)
    expected = _live_refs(engine)
    assert [ref_count(engine.blocks, b) for b in range(engine.blocks.num_blocks)] == expected


# ---- results never change --------------------------------------------------------------------


@pytest.mark.parametrize("max_prefill_tokens", [8192, 5], ids=["whole", "chunked"])
def test_logits_with_a_cached_prefix_equal_those_computed_from_scratch(
    tiny_loaded, max_prefill_tokens
):
    cached = make_engine(tiny_loaded, max_prefill_tokens=max_prefill_tokens)
    plain = make_engine(tiny_loaded, prefix_caching=False, max_prefill_tokens=max_prefill_tokens)
    _first_logits(cached, "warm", [*SYSTEM, 7, 8, 9])
    prompt = [*SYSTEM, 100, 101, 102, 103, 104]
    with_cache = _first_logits(cached, "b", prompt)
    assert cached.blocks.num_hit_tokens == 24  # six full blocks reused, the rest computed
    from_scratch = _first_logits(plain, "b", prompt)
    torch.testing.assert_close(with_cache, from_scratch, rtol=0, atol=2e-5)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("max_prefill_tokens", [8192, 7], ids=["whole", "chunked"])
def test_outputs_are_token_identical_with_caching_on_and_off(
    tiny_loaded, params, max_prefill_tokens
):
    prompts = [
        [*SYSTEM, 1, 2, 3],
        [*SYSTEM, 1, 2, 3, 4, 5, 6, 7, 8],  # extends the first
        [*SYSTEM[:12], 9],  # a shorter prefix of it
        list(SYSTEM[:16]),  # ends exactly on a block edge: its last token is still computed
        [50, 51, 52],
    ]
    on = make_engine(tiny_loaded, max_prefill_tokens=max_prefill_tokens)
    off = make_engine(tiny_loaded, prefix_caching=False, max_prefill_tokens=max_prefill_tokens)
    expected = _outputs(off, prompts, params)
    assert _outputs(on, prompts, params) == expected  # one batch: all share at most the cache
    assert _outputs(on, prompts, params) == expected  # again: now mostly from the cache
    assert on.blocks.num_hit_tokens > 0 and off.blocks.num_hit_tokens == 0
    _check(on)


def test_a_prompt_ending_on_a_block_edge_computes_its_last_block(tiny_loaded):
    engine = make_engine(tiny_loaded)
    prompt = list(SYSTEM[:16])
    _outputs(engine, [prompt])
    engine.add_request(engine.request("again", prompt, GREEDY))
    engine.step()
    request = engine.requests["again"]
    assert request.num_cached_tokens == 12  # three blocks; the fourth holds the last token


# ---- sharing, abort, preemption, eviction --------------------------------------------------------


def test_shared_blocks_survive_one_sharers_abort(tiny_loaded):
    engine = make_engine(tiny_loaded)
    alone = _outputs(make_engine(tiny_loaded), [[*SYSTEM, 60, 61]])[0]
    _outputs(engine, [[*SYSTEM, 1]])  # caches the system prompt
    engine.add_request(engine.request("a", [*SYSTEM, 70, 71], GREEDY))
    engine.add_request(engine.request("b", [*SYSTEM, 60, 61], GREEDY))
    engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    shared = a.block_ids[:6]
    assert shared == b.block_ids[:6] and all(ref_count(engine.blocks, x) == 2 for x in shared)
    engine.abort("a")
    _check(engine)
    assert all(ref_count(engine.blocks, x) == 1 for x in shared)
    tokens = list(b.output_token_ids)
    while "b" in engine.requests:
        tokens += [e.token_id for e in engine.step() if e.request_id == "b" and e.token_id]
    assert tokens == alone
    _check(engine)


def test_eviction_under_pressure_keeps_running_requests_intact(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=24)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    expected = _outputs(make_engine(tiny_loaded, prefix_caching=False), [[*SYSTEM, 5]], params)[0]
    _outputs(engine, [[*SYSTEM, 1]], params)  # cached: 9 blocks
    engine.add_request(engine.request("keep", [*SYSTEM, 5], params))
    outputs: list[int] = []
    flood = random.Random(0)
    for i in range(40):  # a flood of unique prompts evicts what nobody uses, never "keep"'s
        if i % 3 == 0:
            prompt = [flood.randrange(60, 250) for _ in range(flood.randrange(3, 20))]
            engine.add_request(
                engine.request(f"flood-{i}", prompt, SamplingParams(max_new_tokens=2))
            )
        outputs += [e.token_id for e in engine.step() if e.request_id == "keep" and e.token_id]
        _check(engine)
    while "keep" in engine.requests:
        outputs += [e.token_id for e in engine.step() if e.request_id == "keep" and e.token_id]
    assert outputs == expected
    assert engine.blocks.num_cached_blocks < 24  # evicted


def test_preempted_requests_recompute_from_their_cached_blocks(tiny_loaded):
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = [[*SYSTEM, i] for i in range(4)]
    expected = _outputs(make_engine(tiny_loaded, prefix_caching=False), prompts, params)
    engine = make_engine(tiny_loaded, num_blocks=20)  # too few for all four at once
    assert _outputs(engine, prompts, params) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.blocks.num_hit_tokens > 0
    _check(engine)
    assert num_used(engine.blocks) == 0


def test_a_priority_request_takes_the_cache_too(tiny_loaded):
    engine = make_engine(tiny_loaded)
    _outputs(engine, [[*SYSTEM, 1]])
    engine.add_request(engine.request("late", [*SYSTEM, 2], GREEDY, priority=5))
    engine.add_request(engine.request("urgent", [*SYSTEM, 3], GREEDY, priority=1))
    engine.step()
    assert engine.requests["urgent"].num_cached_tokens == 24
    assert engine.requests["late"].num_cached_tokens == 24


def test_random_operations_keep_reference_counts_and_free_lists_consistent(tiny_loaded):
    engine = make_engine(tiny_loaded, num_blocks=24, max_prefill_tokens=9)
    rng = random.Random(1234)
    prefixes = [SYSTEM, SYSTEM[:10], [200 + i for i in range(13)], []]
    ids = iter(range(10**6))
    for _ in range(500):
        op = rng.random()
        if op < 0.35:
            prompt = [
                *rng.choice(prefixes),
                *(rng.randrange(3, 250) for _ in range(rng.randrange(1, 9))),
            ]
            params = SamplingParams(max_new_tokens=rng.randrange(1, 20), ignore_eos=True)
            engine.add_request(
                engine.request(f"r{next(ids)}", prompt, params, priority=rng.choice([1, 5]))
            )
        elif op < 0.5 and engine.requests:
            engine.abort(rng.choice(list(engine.requests)))
        elif op < 0.55:  # a flood of allocations forces eviction of cached blocks
            grabbed = engine.blocks.allocate(
                min(engine.blocks.num_free_blocks, rng.randrange(1, 12))
            )
            engine.blocks.free(grabbed)
        else:
            engine.step()
        _check(engine)
    while engine.has_work():
        engine.step()
    _check(engine)
    assert num_used(engine.blocks) == 0
    assert engine.blocks.num_hit_tokens > 0 and engine.scheduler.num_preemptions > 0


# ---- collisions, counters, switching it off -----------------------------------------------


def test_a_forged_hash_collision_is_detected(tiny_loaded, monkeypatch):
    expected = _outputs(make_engine(tiny_loaded, prefix_caching=False), [[*SYSTEM, 1], [70] * 30])
    monkeypatch.setattr(prefix_hash, "chain_hash", lambda parent, tokens: b"same for all")
    engine = make_engine(tiny_loaded)
    assert _outputs(engine, [[*SYSTEM, 1]]) == expected[:1]
    assert _outputs(engine, [[70] * 30]) == expected[1:]  # every block "matches" by hash
    assert engine.blocks.num_collisions > 0 and engine.blocks.num_hit_tokens == 0


def test_the_block_manager_confirms_tokens_and_parent():
    blocks = BlockManager(8, 2, enabled=True, root=b"model")
    tokens = [1, 2, 3, 4]
    hashes = blocks.extend_hashes([], tokens, 4)
    owned = blocks.allocate(2)
    blocks.register(owned, hashes, tokens, 0)
    assert blocks.match(hashes, tokens, 2) == owned
    other_root = BlockManager(8, 2, enabled=True, root=b"other model").extend_hashes([], tokens, 4)
    assert blocks.match(other_root, tokens, 2) == []  # another model's chain never matches
    assert blocks.match(hashes, [1, 2, 3, 5], 2) == owned[:1]  # confirmed by tokens: caught
    assert blocks.num_collisions == 1


def test_cached_free_blocks_are_evicted_oldest_first_and_count_as_free():
    blocks = BlockManager(4, 1, enabled=True)
    for token in (1, 2):
        owned = blocks.allocate(1)
        blocks.register(owned, blocks.extend_hashes([], [token], 1), [token], 0)
        blocks.free(owned)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 2
    blocks.allocate(3)  # two empty blocks, then the oldest cached one
    assert blocks.match(blocks.extend_hashes([], [1], 1), [1], 1) == []
    assert len(blocks.match(blocks.extend_hashes([], [2], 1), [2], 1)) == 1
    check_consistent(blocks)


def test_cache_counters_and_stats(tiny_loaded):
    engine = make_engine(tiny_loaded)
    _outputs(engine, [[*SYSTEM, 1], [*SYSTEM, 2]])
    stats = engine.stats()
    assert stats.prefix_cache_queries == 2 * 27
    assert stats.prefix_cache_hits in (0, 24)  # the same batch: only if admitted a step later
    events = []
    engine.add_request(engine.request("c", [*SYSTEM, 3], GREEDY))
    while "c" in engine.requests:
        events += [e for e in engine.step() if e.request_id == "c"]
    assert {e.num_cached_tokens for e in events} == {24}
    assert engine.stats().num_cached_blocks >= 6


def test_caching_off_reuses_nothing(tiny_loaded):
    engine = make_engine(tiny_loaded, prefix_caching=False)
    _outputs(engine, [[*SYSTEM, 1], [*SYSTEM, 1]])
    _outputs(engine, [[*SYSTEM, 1]])
    stats = engine.stats()
    assert stats.num_cached_blocks == stats.prefix_cache_queries == stats.prefix_cache_hits == 0


def test_a_one_token_prompt_chunk_is_attended_as_a_chunk(tiny_loaded):
    """The step's last unit of prefill budget may start a prompt with a single token: its
    attention (and so its KV in later layers) is a prompt chunk's, not garbage."""
    prompts = [[*SYSTEM, 1, 2, 3], [*SYSTEM, 4, 5, 6, 7, 8, 9, 10, 11], [*SYSTEM[:12], 9]]
    whole = _outputs(make_engine(tiny_loaded, prefix_caching=False), prompts)
    chunked = make_engine(tiny_loaded, prefix_caching=False, max_prefill_tokens=7)
    one_token_chunks = []
    schedule = chunked.scheduler.schedule

    def recording():
        out = schedule()
        one_token_chunks.extend(n for _, n in out.prefills if n == 1)
        return out

    chunked.scheduler.schedule = recording
    assert _outputs(chunked, prompts) == whole
    assert one_token_chunks
