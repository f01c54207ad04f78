"""Sessions (``prompt_cache_key``): a conversation's blocks outlive other cached blocks for
``kv_session_ttl_s``, then are evicted like any other; a tier deletes them last too."""

from __future__ import annotations

import time

from engine.config import CacheConfig, EngineConfig
from engine.kv_tiers.block_file import BlockRecord
from engine.kv_tiers.file_tier import FileTier
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.support.block_checks import check_consistent

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
HISTORY = list(range(20, 45))  # 25 tokens: six full blocks of 4
OTHERS = [list(range(100 + 40 * i, 125 + 40 * i)) for i in range(4)]


def _engine(loaded, ttl_s: int = 600) -> LLMEngine:
    cache = CacheConfig(block_size=4, num_blocks=16, session_ttl_s=ttl_s)
    return LLMEngine(EngineConfig(model_path=str(loaded.path), device="cpu", cache=cache), loaded)


def _cached_tokens(engine: LLMEngine, prompt: list[int], cache_key: str = "") -> int:
    engine.add_request(engine.request("r", prompt, GREEDY, cache_key=cache_key))
    events = []
    while engine.has_work():
        events += engine.step()
    check_consistent(engine.blocks)
    return events[-1].num_cached_tokens


def test_a_sessions_blocks_outlive_the_others_until_their_time_is_over(tiny_loaded):
    engine = _engine(tiny_loaded)
    _cached_tokens(engine, HISTORY, cache_key="conversation")
    for prompt in OTHERS:  # four prompts of six blocks each through a cache of 16
        _cached_tokens(engine, prompt)
    assert _cached_tokens(engine, HISTORY + [7]) == 24  # the session's six blocks stayed
    engine.blocks.expire_preferences(time.monotonic() + 601)
    for prompt in OTHERS:
        _cached_tokens(engine, prompt)
    assert _cached_tokens(engine, HISTORY + [8]) == 0


def test_without_a_key_or_with_sessions_off_the_history_is_evicted(tiny_loaded):
    for engine, key in ((_engine(tiny_loaded), ""), (_engine(tiny_loaded, 0), "conversation")):
        _cached_tokens(engine, HISTORY, cache_key=key)
        for prompt in OTHERS:
            _cached_tokens(engine, prompt)
        assert _cached_tokens(engine, HISTORY + [7]) == 0


def test_a_tier_deletes_a_sessions_blocks_last(tmp_path):
    tier = FileTier("host", tmp_path, 4000, "layout")  # room for three files
    records = [BlockRecord(bytes([n]) * 16, b"\0" * 16, (n,), bytes(1000)) for n in range(4)]
    tier.keep = lambda block_hash: block_hash == records[0].block_hash
    for record in records:
        tier.store(record)
    assert records[0].block_hash in tier and records[1].block_hash not in tier
