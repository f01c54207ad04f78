"""Prefixes pulled from a peer engine (engine/kv_pull.py), with the pages handed over as a
transport hands them over: the puller serves them as cached tokens with the very tokens it would
compute; pages of another prefix, secret, layout or size are refused and free every block."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.errors import KVImportError
from engine.kv_pull import PullTicket, export_prefix
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.transfer.codec import page_bytes
from tests.conftest import make_engine
from tests.support.block_checks import check_consistent

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = list(range(20, 61))  # 41 tokens: ten full blocks of 4, the last token computed


def _run(engine: LLMEngine, prompt: list[int], request_id: str = "r") -> tuple[list[int], int]:
    engine.add_request(engine.request(request_id, prompt, GREEDY))
    events = []
    while engine.has_work():
        events += engine.step()
    check_consistent(engine.blocks)
    return [e.token_id for e in events if e.token_id is not None], events[-1].num_cached_tokens


def _pull(puller: LLMEngine, source: LLMEngine, prompt: list[int], num_blocks: int) -> int:
    """Open a pull on ``puller``, export on ``source``, install: the blocks installed."""
    ticket = puller.pulls.open(prompt, "", num_blocks, timeout_s=10)
    assert ticket is not None
    payload = export_prefix(source, prompt, "", ticket)
    assert payload is not None
    pull = puller.pulls.take(payload)
    error = puller.pulls.write(pull, payload)
    return puller.pulls.finish(pull, payload.blocks.shape[2], error)


def test_a_pulled_prefix_is_served_as_cached_tokens(tiny_loaded):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    computed, _ = _run(source, PROMPT)
    assert _pull(puller, source, PROMPT, 10) == 10
    again, cached = _run(puller, PROMPT)
    assert again == computed and cached == 40
    assert puller.stats().kv_pulled_blocks == 10 and source.stats().kv_exported_blocks == 10
    assert puller.pulls.num_open == 0


def test_only_the_blocks_past_the_pullers_own_prefix_travel(tiny_loaded):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    computed, _ = _run(source, PROMPT)
    _run(puller, PROMPT[:17], "short")  # four blocks of its own
    ticket = puller.pulls.open(PROMPT, "", 10, timeout_s=10)
    assert ticket is not None and (ticket.first_block, ticket.num_blocks) == (4, 6)
    payload = export_prefix(source, PROMPT, "", ticket)
    assert payload is not None and payload.blocks.shape[2] == 6
    pull = puller.pulls.take(payload)
    assert puller.pulls.finish(pull, 6, puller.pulls.write(pull, payload)) == 6
    assert _run(puller, PROMPT) == (computed, 40)


def test_a_source_that_lost_the_tail_sends_what_it_holds(tiny_loaded):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    _run(source, PROMPT[:25])  # six blocks
    assert _pull(puller, source, PROMPT, 10) == 6
    assert _run(puller, PROMPT)[1] == 24


def test_a_source_exports_from_its_tiers(tiny_loaded, tmp_path: Path):
    cache = CacheConfig(block_size=4, num_blocks=24, host_tier_mb=4,
                        host_tier_path=str(tmp_path / "shm"))  # fmt: skip
    config = EngineConfig(model_path=str(tiny_loaded.path), device="cpu", cache=cache)
    source, puller = LLMEngine(config, tiny_loaded), make_engine(tiny_loaded)
    computed, _ = _run(source, PROMPT)
    others = [list(range(100 + 50 * i, 141 + 50 * i)) for i in range(3)]
    source.generate(others, GREEDY)  # PROMPT leaves the cache for the shared tier
    assert source.blocks.lookup([], PROMPT) == [] and source.tiers is not None
    source.tiers.flush()
    ticket = PullTicket("pull-x", "s" * 32, 0, 10)
    sent = export_prefix(source, PROMPT, "", ticket)
    assert sent is not None and len(page_bytes(sent)) == sent.num_bytes  # as a transport sends
    assert _pull(puller, source, PROMPT, 10) == 10
    assert _run(puller, PROMPT) == (computed, 40)


def test_nothing_to_pull_when_the_cache_holds_it_or_has_no_room(tiny_loaded):
    puller = make_engine(tiny_loaded)
    _run(puller, PROMPT)
    assert puller.pulls.open(PROMPT, "", 10, timeout_s=10) is None  # held already
    small = make_engine(tiny_loaded, num_blocks=4)
    assert small.pulls.open(PROMPT, "", 10, timeout_s=10) is None
    assert small.blocks.num_free_blocks == 4


def test_a_source_without_the_prefix_sends_nothing(tiny_loaded):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    ticket = puller.pulls.open(PROMPT, "", 10, timeout_s=10)
    assert ticket is not None and export_prefix(source, PROMPT, "", ticket) is None
    assert puller.pulls.cancel(ticket.pull_id)
    assert puller.blocks.num_free_blocks == 256 and puller.pulls.stats.failed == 1


@pytest.mark.parametrize("forgery", ["secret", "tokens", "first_block", "layout", "too_many"])
def test_pages_at_odds_with_the_pull_are_refused(tiny_loaded, forgery):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    _run(source, PROMPT)
    ticket = puller.pulls.open(PROMPT, "", 5, timeout_s=10)
    assert ticket is not None
    payload = export_prefix(source, PROMPT, "", ticket)
    assert payload is not None
    if forgery == "secret":
        payload.token = "0" * 32
    elif forgery == "tokens":
        payload.state.token_ids[3] += 1
    elif forgery == "first_block":
        payload.state.first_block = 1
    elif forgery == "layout":
        payload.layout = dataclasses.replace(payload.layout, block_size=8)
    else:
        bigger = PullTicket(ticket.pull_id, ticket.secret, 0, 8)
        payload = export_prefix(source, PROMPT, "", bigger)
        assert payload is not None
    with pytest.raises(KVImportError):
        puller.pulls.take(payload)
    assert puller.pulls.num_open == 1  # still waiting for the right pages
    puller.pulls.expire(now=float("inf"))
    assert puller.pulls.num_open == 0 and puller.blocks.num_free_blocks == 256
    assert puller.blocks.lookup([], PROMPT) == []


def test_another_tenants_prefix_is_not_a_match(tiny_loaded):
    source, puller = make_engine(tiny_loaded), make_engine(tiny_loaded)
    _run(source, PROMPT)  # no tenant
    ticket = puller.pulls.open(PROMPT, "acme", 10, timeout_s=10)
    assert ticket is not None
    assert export_prefix(source, PROMPT, "acme", ticket) is None
