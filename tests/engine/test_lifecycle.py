"""Block-manager lifecycle under continuous batching: nothing leaks, a full cache never fails."""

from __future__ import annotations

import random

import pytest

from engine.errors import RequestRejectedError
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.block_checks import num_used


def _assert_no_leak(engine) -> None:
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert num_used(engine.blocks) == 0
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_500_random_operations_leak_no_block(tiny_loaded):
    engine = make_engine(
        tiny_loaded, block_size=4, num_blocks=40, max_prefill_tokens=16, max_batch_size=6
    )
    rng = random.Random(7)
    live: list[str] = []
    finished: dict[str, FinishReason] = {}
    for op in range(500):
        choice = rng.random()
        if choice < 0.35:
            request_id = f"r{op}"
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(
                max_new_tokens=rng.randrange(1, 25), do_sample=rng.random() < 0.5, ignore_eos=True
            )
            engine.add_request(
                engine.request(request_id, prompt, params, priority=rng.randrange(1, 6))
            )
            live.append(request_id)
        elif choice < 0.5 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        for event in engine.step():
            if event.finished:
                finished[event.request_id] = event.finish_reason
        assert num_used(engine.blocks) + engine.blocks.num_free_blocks == 40
    while engine.has_work():
        for event in engine.step():
            if event.finished:
                finished[event.request_id] = event.finish_reason
    _assert_no_leak(engine)
    assert set(finished.values()) <= {FinishReason.LENGTH, FinishReason.ABORT}
    assert FinishReason.LENGTH in finished.values() and FinishReason.ABORT in finished.values()


def test_full_cache_makes_requests_wait_and_none_fails(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4, num_blocks=12)  # 48 token slots
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for i in range(8):  # 8 x 30 tokens >> 48 slots
        engine.add_request(engine.request(f"r{i}", [7 + i] * 10, params))
    most_waiting, lengths = 0, {}
    while engine.has_work():
        most_waiting = max(most_waiting, engine.stats().num_waiting)
        for event in engine.step():
            assert event.error is None
            if event.finished:
                lengths[event.request_id] = (event.num_output_tokens, event.finish_reason)
    assert most_waiting >= 6
    assert lengths == {f"r{i}": (20, FinishReason.LENGTH) for i in range(8)}
    _assert_no_leak(engine)


def test_preempted_request_recomputes_to_the_same_tokens(tiny_loaded):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [[9, 8, 7, 6, 5], [3, 4, 5, 6, 7, 8], [10, 11, 12]]
    roomy = make_engine(tiny_loaded, block_size=4, num_blocks=64).generate(prompts, params)
    tight = make_engine(tiny_loaded, block_size=4, num_blocks=10)  # 40 slots for ~3 x 30 tokens
    assert tight.generate(prompts, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    _assert_no_leak(tight)


def test_abort_frees_blocks_in_every_state(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4, num_blocks=64, max_prefill_tokens=4)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    engine.add_request(engine.request("decoding", [5] * 6, params))
    for _ in range(4):
        engine.step()
    engine.add_request(engine.request("mid-prefill", [6] * 30, params))
    engine.step()
    engine.add_request(engine.request("waiting", [7] * 10, params, priority=5))
    engine.add_request(engine.request("held", [8] * 5, params, prefill_only=True))
    while engine.requests["held"].status.name != "HELD":
        engine.step()
    assert (
        engine.importer.reserve_import(
            engine.request("incoming", [9] * 9, params, disaggregated=True)
        )
        is not None
    )
    for request_id in ["decoding", "mid-prefill", "waiting", "held", "incoming"]:
        assert engine.abort(request_id)
    events = engine.step()
    assert {e.request_id for e in events} == {
        "decoding",
        "mid-prefill",
        "waiting",
        "held",
        "incoming",  # a reservation is a request: it ends like one
    }
    assert all(e.finish_reason == FinishReason.ABORT for e in events)
    _assert_no_leak(engine)


def test_priority_one_is_served_first_fcfs_within(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4, num_blocks=64, max_batch_size=1)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for request_id, priority in [("a5", 5), ("b3", 3), ("c1", 1), ("d3", 3), ("e1", 1)]:
        engine.add_request(engine.request(request_id, [5, 6, 7], params, priority=priority))
    order = []
    while engine.has_work():
        order += [e.request_id for e in engine.step() if e.finished]
    assert order == ["c1", "e1", "b3", "d3", "a5"]


def test_chunked_prefill_respects_the_token_budget(tiny_loaded):
    engine = make_engine(tiny_loaded, max_prefill_tokens=8, max_prefill_batch_size=2)
    budgets = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        budgets.append((sum(n for _, n in out.prefills), len(out.prefills)))
        return out

    engine.scheduler.schedule = recording_schedule
    prompts = [list(range(3, 40)), [3, 4, 5], list(range(50, 70)), [9, 9]]
    engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert all(tokens <= 8 and count <= 2 for tokens, count in budgets)
    assert sum(tokens for tokens, _ in budgets) == 37 + 3 + 20 + 2  # each prompt token once


def test_requests_that_can_never_fit_are_rejected(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=4, num_blocks=4, max_input_token_len=100)
    with pytest.raises(RequestRejectedError, match="cache holds 16"):
        engine.add_request(engine.request("big", [5] * 20, SamplingParams(max_new_tokens=1)))
    with pytest.raises(RequestRejectedError, match=r"valid range is \[1, 100\]"):
        engine.add_request(engine.request("long", [5] * 101, SamplingParams(max_new_tokens=1)))
    with pytest.raises(RequestRejectedError, match="valid range"):
        engine.add_request(engine.request("empty", [], SamplingParams()))
    _assert_no_leak(engine)


def test_prompt_tokens_to_compute_count_a_prompt_mid_chunk_and_not_decodes(tiny_loaded):
    engine = make_engine(tiny_loaded, max_prefill_tokens=16)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.add_request(engine.request("long", list(range(3, 43)), params))  # chunks of 16
    engine.add_request(engine.request("short", [5, 6, 7], params))
    assert engine.stats().num_prompt_tokens_to_compute == 43
    engine.step()  # 16 of the long prompt
    assert engine.stats().num_prompt_tokens_to_compute == 27
    while engine.requests["short"].num_computed_tokens < 3:
        engine.step()
    assert engine.stats().num_prompt_tokens_to_compute == 0  # decoding requests add nothing
    while engine.has_work():
        engine.step()
