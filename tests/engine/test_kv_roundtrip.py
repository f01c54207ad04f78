"""KV export/import in one process: prefill in engine A, decode in engine B."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.errors import KVImportError
from engine.request import FinishReason, RequestStatus
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.block_checks import num_used
from tests.support.kv_import import import_kv

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45)), [3]]
PARAMS = [
    SamplingParams(max_new_tokens=16, ignore_eos=True),
    SamplingParams(
        max_new_tokens=16, do_sample=True, temperature=1.3, top_p=0.9, seed=42, ignore_eos=True
    ),
    SamplingParams(max_new_tokens=16, do_sample=True, top_k=20, seed=7, ignore_eos=True),
]


def _prefill(engine, request_id, prompt, params):
    engine.add_request(engine.request(request_id, prompt, params, prefill_only=True))
    first = None
    while engine.requests[request_id].status != RequestStatus.HELD:
        for event in engine.step():
            first = event.token_id
    return first


def _decode(engine, request_id):
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.request_id == request_id]
    return tokens


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_prefill_in_a_decode_in_b_equals_one_engine(tiny_loaded, case):
    prompt, params = PROMPTS[case], PARAMS[case]
    expected = make_engine(tiny_loaded).generate([prompt], params)[0]
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=32)
    first = _prefill(prefill, "req", prompt, params)
    payload = prefill.export_kv("req")
    assert payload.state.num_computed_tokens == len(prompt)
    assert payload.num_bytes > 0 and payload.blocks.is_contiguous()
    assert (
        decode.importer.reserve_import(decode.request("req", prompt, params, disaggregated=True))
        is not None
    )
    import_kv(decode, payload, max_output_tokens=params.max_new_tokens)
    prefill.release("req")
    assert num_used(prefill.blocks) == 0
    assert [first, *_decode(decode, "req")] == expected
    assert num_used(decode.blocks) == 0


def test_an_imported_request_counts_its_time_per_token_from_when_its_pages_arrived(tiny_loaded):
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, "req", PROMPTS[1], PARAMS[0])
    before = time.monotonic()
    import_kv(decode, prefill.export_kv("req"), max_output_tokens=4)
    request = decode.requests["req"]
    assert request.num_output_tokens == 1  # the prefill side's first token, before any step
    assert before <= request.first_token_time <= time.monotonic()
    first = request.first_token_time
    decode.step()
    assert request.first_token_time == first and request.num_output_tokens == 2


def test_imported_blocks_are_bit_exact(tiny_loaded):
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, "req", PROMPTS[1], PARAMS[0])
    payload = prefill.export_kv("req")
    import_kv(decode, payload, max_output_tokens=4)
    installed = decode.kv_cache.export_blocks(
        decode.requests["req"].block_ids[: payload.blocks.shape[2]]
    )
    assert torch.equal(installed, payload.blocks)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 8),
        ("dtype", "torch.float16"),
        ("model_fingerprint", "other-model"),
        ("num_layers", 3),
    ],
)
def test_handshake_mismatch_is_refused_and_frees_the_reservation(tiny_loaded, field, value):
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, "req", PROMPTS[0], PARAMS[0])
    payload = prefill.export_kv("req")
    payload.layout = dataclasses.replace(payload.layout, **{field: value})
    decode.importer.reserve_import(decode.request("req", PROMPTS[0], PARAMS[0], disaggregated=True))
    with pytest.raises(KVImportError, match=field):
        import_kv(decode, payload, max_output_tokens=4)
    assert num_used(decode.blocks) == 0 and "req" not in decode.requests


def test_reserve_refuses_when_the_cache_is_full(tiny_loaded):
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=3)
    # 3 blocks with room for the next token
    assert (
        decode.importer.reserve_import(decode.request("a", [5] * 8, PARAMS[0], disaggregated=True))
        is not None
    )
    assert (
        decode.importer.reserve_import(decode.request("b", [5], PARAMS[0], disaggregated=True))
        is None
    )
    decode.abort("a")
    assert num_used(decode.blocks) == 0


# ---- a reservation is a request (RESERVED, then RECEIVING) -------------------------------------


def _payload(tiny_loaded, request_id="req"):
    prefill = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, request_id, PROMPTS[0], PARAMS[0])
    return prefill.export_kv(request_id, max_output_tokens=4)


def test_a_reservation_is_a_request_that_aborts_like_one(tiny_loaded):
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=8)
    reserved = decode.importer.reserve_import(
        decode.request("req", PROMPTS[0], PARAMS[0], disaggregated=True), timeout_s=30
    )
    assert reserved is decode.requests["req"] and reserved.status == RequestStatus.RESERVED
    assert decode.stats().num_reserved == 1 and num_used(decode.blocks) == 2
    assert decode.abort("req")
    [event] = decode.step()
    assert (event.request_id, event.finish_reason) == ("req", FinishReason.ABORT)
    assert num_used(decode.blocks) == 0 and not decode.requests


def test_a_reservation_past_its_deadline_ends_with_an_error(tiny_loaded):
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=8)
    reserved = decode.importer.reserve_import(
        decode.request("late", PROMPTS[0], PARAMS[0], disaggregated=True), timeout_s=2
    )
    decode.importer.reserve_import(
        decode.request("no-deadline", PROMPTS[2], PARAMS[0], disaggregated=True)
    )
    decode.importer.expire_reservations(now=reserved.arrival_time + 1.9)
    assert "late" in decode.requests
    decode.importer.expire_reservations(now=reserved.arrival_time + 2.1)
    [event] = decode.step()
    assert event.finish_reason == FinishReason.ERROR
    assert event.error == "KV pages did not arrive within 2 s"
    assert list(decode.requests) == ["no-deadline"] and num_used(decode.blocks) == 1


def test_pages_arriving_after_the_deadline_are_refused(tiny_loaded):
    payload = _payload(tiny_loaded)
    decode = make_engine(tiny_loaded, block_size=4)
    reserved = decode.importer.reserve_import(
        decode.request("req", PROMPTS[0], PARAMS[0], disaggregated=True), timeout_s=1
    )
    decode.importer.expire_reservations(now=reserved.arrival_time + 5)
    with pytest.raises(KVImportError, match="no reservation"):
        decode.importer.take_reservation(payload)


def test_abort_while_the_pages_are_written_frees_the_blocks_after_the_write(tiny_loaded):
    payload = _payload(tiny_loaded)
    decode = make_engine(tiny_loaded, block_size=4)
    decode.importer.reserve_import(
        decode.request("req", PROMPTS[0], PARAMS[0], disaggregated=True), timeout_s=30
    )
    request = decode.importer.take_reservation(payload)  # the transport thread's part, first half
    assert request.status == RequestStatus.RECEIVING
    with pytest.raises(KVImportError, match="no reservation"):
        decode.importer.take_reservation(payload)  # taken once only
    decode.importer.expire_reservations(now=request.arrival_time + 60)  # no expiry while receiving
    assert decode.abort("req")  # the engine thread, meanwhile
    assert num_used(decode.blocks) == 2  # still being written to
    assert decode.importer.write_pages(request, payload) is None
    decode.importer.finish_receive(request, payload.state)
    assert num_used(decode.blocks) == 0 and not decode.requests
    assert [e.finish_reason for e in decode.step()] == [FinishReason.ABORT]


def test_a_failed_write_ends_the_request_with_its_error(tiny_loaded):
    payload = _payload(tiny_loaded)
    decode = make_engine(tiny_loaded, block_size=4)
    decode.importer.reserve_import(decode.request("req", PROMPTS[0], PARAMS[0], disaggregated=True))
    request = decode.importer.take_reservation(payload)
    decode.importer.finish_receive(request, payload.state, error="KV install failed: out of memory")
    [event] = decode.step()
    assert event.error == "KV install failed: out of memory"
    assert num_used(decode.blocks) == 0 and not decode.requests


def test_status_order_puts_the_reservation_first_and_finished_last():
    order = sorted(RequestStatus)
    assert order[:2] == [RequestStatus.RESERVED, RequestStatus.RECEIVING]
    assert order[-1] == RequestStatus.FINISHED
