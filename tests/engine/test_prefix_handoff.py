"""The hand-off moves only what the decode worker lacks: a second request with the same prefix
sends only its new blocks (counted in bytes), over the real ZMQ and gRPC transports, and its
output is what one engine alone makes of it."""

from __future__ import annotations

import contextlib

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.kv_cache import bytes_per_block
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.conftest import make_engine
from tests.support.block_checks import check_consistent, num_used, ref_count
from tests.support.channel_reader import ChannelReader
from tests.support.inprocess_workers import _assert_freed, _stop
from tests.support.kv_import import import_kv
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget

SYSTEM = list(range(20, 46))  # 26 tokens
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
TRANSPORTS = {"zmq": ("zmq", False), "zmq_shm": ("zmq", True), "grpc": ("grpc", True)}


def _config(model_dir, prefix_caching: bool = True) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=prefix_caching)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


@contextlib.contextmanager
def _workers(model_dir, transfer: KVTransferConfig, prefix_caching: bool = True):
    """A prefill and a decode worker over ``transfer`` and a coordinator's reader of both,
    stopped on the way out."""
    prefill = PrefillWorker(_config(model_dir, prefix_caching), transfer)
    decode = DecodeWorker(_config(model_dir, prefix_caching), transfer)
    reader = ChannelReader(prefill, decode)
    try:
        yield prefill, decode, reader
    finally:
        reader.close()
        _stop(prefill, decode)


@pytest.fixture(params=list(TRANSPORTS))
def pair(request, tiny_model_dir):
    transport, shared_memory = TRANSPORTS[request.param]
    transfer = KVTransferConfig(transport, transfer_timeout_s=5.0, shared_memory=shared_memory)
    with _workers(tiny_model_dir, transfer) as workers:
        yield workers


def _handoff(pair, request_id: str, prompt: list[int]):
    """Run one request through the pair: (reservation, hand-off result, all token events)."""
    prefill, decode, reader = pair
    request = reader.request(GenerationRequest(request_id, prompt, PARAMS))
    reservation = decode.reserve(request)
    assert reservation.granted, reservation.reason
    assert prefill.prefill(request, HandoffTarget.from_reservation(reservation, 6)).accepted
    items = reader.items(prefill, request_id)
    result = items[-1]
    assert isinstance(result, HandoffResult) and result.ok, result
    events = [i for i in items if isinstance(i, TokenEvent)] + reader.items(decode, request_id)
    assert events[-1].finish_reason == FinishReason.LENGTH
    return reservation, result, events


def test_a_shared_prefix_moves_only_the_new_blocks(pair, tiny_loaded):
    prefill, decode, _ = pair
    block_bytes = bytes_per_block(prefill.engine.shape, 4, prefill.engine.kv_cache.data.dtype)
    first_prompt, second_prompt = [*SYSTEM, 1, 2], [*SYSTEM, 1, 2, 3, 4, 5]
    first, first_result, _ = _handoff(pair, "first", first_prompt)
    assert first.num_cached_blocks == 0
    assert first_result.num_bytes == 7 * block_bytes  # 28 prompt tokens: all seven blocks
    second, second_result, events = _handoff(pair, "second", second_prompt)
    # the decode worker holds the first prompt's seven blocks; only the eighth moves
    assert second.num_cached_blocks == 7
    assert second_result.num_bytes == 1 * block_bytes
    assert {e.num_cached_tokens for e in events} == {28}  # the prefill side computed 3 tokens
    alone = make_engine(tiny_loaded, prefix_caching=False)
    expected = alone.generate([first_prompt, second_prompt], PARAMS)[1]
    assert [e.token_id for e in events if e.token_id is not None] == expected
    assert decode.load().stats.num_used_blocks == 0  # cached blocks stay, unused
    assert decode.load().stats.num_cached_blocks >= 7


def test_without_caching_every_block_moves(tiny_model_dir):
    transfer = KVTransferConfig("zmq", shared_memory=False)
    with _workers(tiny_model_dir, transfer, prefix_caching=False) as pair:
        block_bytes = bytes_per_block(pair[0].engine.shape, 4, pair[0].engine.kv_cache.data.dtype)
        _handoff(pair, "first", [*SYSTEM, 1, 2])
        second, result, events = _handoff(pair, "second", [*SYSTEM, 1, 2, 3, 4, 5])
        assert second.num_cached_blocks == 0 and result.num_bytes == 8 * block_bytes
        assert {e.num_cached_tokens for e in events} == {0}


def test_pages_that_start_at_the_wrong_block_are_refused(tiny_model_dir):
    """A sender that ignores the reservation's cached blocks (or forges a start) is refused,
    and both sides free everything."""
    transfer = KVTransferConfig("zmq", shared_memory=False, transfer_timeout_s=5.0)
    with _workers(tiny_model_dir, transfer) as pair:
        prefill, decode, reader = pair
        _handoff(pair, "first", [*SYSTEM, 1, 2])
        request = reader.request(GenerationRequest("second", [*SYSTEM, 1, 2, 3], PARAMS))
        reservation = decode.reserve(request)
        assert reservation.num_cached_blocks == 7
        target = HandoffTarget(reservation.endpoint, 6, reservation.token, first_block=0)
        assert prefill.prefill(request, target).accepted
        result = reader.items(prefill, "second")[-1]
        assert isinstance(result, HandoffResult) and not result.ok
        assert "leading blocks" in result.error or "blocks arrived" in result.error
        assert decode.abort("second")  # as the coordinator does after a failed hand-off
        assert decode.load().stats.num_used_blocks == 0
        _assert_freed(prefill)  # prefill frees its blocks right after the result


# ---- the decode engine's side, engine to engine ----------------------------------------------


def _prefill(engine, request_id: str, prompt: list[int], outputs=()) -> None:
    engine.add_request(
        engine.request(request_id, prompt, PARAMS, prefill_only=True, output_token_ids=outputs)
    )
    while engine.requests[request_id].first_token_time is None:
        engine.step()


def _decode_to_end(engine, request_id: str) -> list[int]:
    tokens = list(engine.requests[request_id].output_token_ids)
    while request_id in engine.requests:
        tokens += [e.token_id for e in engine.step() if e.request_id == request_id and e.token_id]
    return tokens


def _consistent(engine) -> None:
    check_consistent(engine.blocks)
    held = [0] * engine.blocks.num_blocks
    for request in engine.requests.values():
        for block_id in request.block_ids:
            held[block_id] += 1
    assert [ref_count(engine.blocks, b) for b in range(engine.blocks.num_blocks)] == held


def test_import_kv_works_again_once_the_decode_engine_caches_the_prefix(tiny_loaded):
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    alone = make_engine(tiny_loaded, prefix_caching=False)
    for request_id in ("a", "b"):
        _prefill(prefill, request_id, [*SYSTEM, 1, 2])
        import_kv(decode, prefill.export_kv(request_id, 6))  # all pages: from block 0
        prefill.release(request_id)
        assert decode.requests[request_id].num_shared_blocks == 0
        assert _decode_to_end(decode, request_id) == alone.generate([[*SYSTEM, 1, 2]], PARAMS)[0]
    _consistent(decode)


def test_ending_a_reservation_that_shares_blocks_keeps_the_counts(tiny_loaded):
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    _prefill(prefill, "warm", [*SYSTEM, 1, 2])
    import_kv(decode, prefill.export_kv("warm", 6))
    _decode_to_end(decode, "warm")
    ends = {
        "aborted reserved": lambda r: decode.abort(r.request_id),
        "expired": lambda r: decode.importer.expire_reservations(now=r.deadline + 1),
        "aborted receiving": lambda r: _abort_while_receiving(prefill, decode, r),
    }
    for i, (name, end) in enumerate(ends.items()):
        reserved = decode.importer.reserve_import(
            decode.request(f"r{i}", [*SYSTEM, 1, 2, 3], PARAMS, disaggregated=True), timeout_s=5.0
        )
        assert reserved.num_shared_blocks == 7, name
        shared = reserved.block_ids[:7]
        assert all(ref_count(decode.blocks, b) == 1 for b in shared)
        end(reserved)
        assert f"r{i}" not in decode.requests, name
        assert all(ref_count(decode.blocks, b) == 0 for b in shared), name
        _consistent(decode)
    assert num_used(decode.blocks) == 0 and decode.blocks.num_cached_blocks >= 7


def _abort_while_receiving(prefill, decode, reserved) -> None:
    request_id = reserved.request_id
    _prefill(prefill, request_id, [*SYSTEM, 1, 2, 3])
    payload = prefill.export_kv(request_id, 6, first_block=reserved.num_shared_blocks)
    prefill.release(request_id)
    payload.token = decode.requests[request_id].reservation_token
    receiving = decode.importer.take_reservation(payload)
    decode.abort(request_id)  # while its pages are being written: blocks stay until the write ends
    assert decode.importer.write_pages(receiving, payload) is None
    decode.importer.finish_receive(receiving, payload.state)


def test_a_migrated_request_shares_the_blocks_its_outputs_filled(tiny_loaded):
    """A request continued after outputs it made elsewhere: the decode worker holds the prompt
    and the earlier outputs' blocks already; only the rest moves, and it goes on as if never
    moved."""
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    full = make_engine(tiny_loaded, prefix_caching=False).generate([[*SYSTEM, 1, 2]], params)[0]
    _prefill(prefill, "first", [*SYSTEM, 1, 2])
    import_kv(decode, prefill.export_kv("first", 12))
    prefill.release("first")
    assert _decode_to_end(decode, "first") == full
    outputs = full[:7]  # 28 prompt + 7 outputs: eight full blocks were computed here
    reserved = decode.importer.reserve_import(
        decode.request(
            "moved", [*SYSTEM, 1, 2], params, output_token_ids=outputs, disaggregated=True
        ),
        token="t",
    )
    assert reserved.num_shared_blocks == 8
    engine_params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prefill.add_request(
        prefill.request(
            "moved", [*SYSTEM, 1, 2], engine_params, prefill_only=True, output_token_ids=outputs
        )
    )
    while prefill.requests["moved"].first_token_time is None:
        prefill.step()
    payload = prefill.export_kv("moved", 12, first_block=8)
    payload.token = "t"
    assert payload.blocks.shape[2] == 9 - 8  # 35 tokens: nine blocks, one moves
    request = decode.importer.take_reservation(payload)
    assert decode.importer.write_pages(request, payload) is None
    decode.importer.finish_receive(request, payload.state)
    assert _decode_to_end(decode, "moved") == full
    _consistent(decode)
