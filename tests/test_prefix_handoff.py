"""The hand-off moves only what the decode worker lacks: a second request with the same prefix
sends only its new blocks (counted in bytes), over the real ZMQ and gRPC transports, and its
output is what one engine alone makes of it."""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.kv_cache import bytes_per_block
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.worker.contracts import GenerationRequest, HandoffResult, HandoffTarget
from prefill_worker.worker import PrefillWorker
from tests.conftest import make_engine

SYSTEM = list(range(20, 46))  # 26 tokens
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
TRANSPORTS = {"zmq": ("zmq", False), "zmq_shm": ("zmq", True), "grpc": ("grpc", True)}


def _config(model_dir, prefix_caching: bool = True) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=prefix_caching)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


@pytest.fixture(params=list(TRANSPORTS))
def pair(request, tiny_model_dir):
    transport, shared_memory = TRANSPORTS[request.param]
    transfer = KVTransferConfig(transport, transfer_timeout_s=5.0, shared_memory=shared_memory)
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    yield prefill, decode
    for worker in (prefill, decode):
        worker.loop.stop()
    decode.receiver.close()
    prefill.sender.close()


def _handoff(prefill, decode, request_id: str, prompt: list[int]):
    """Run one request through the pair: (reservation, hand-off result, all token events)."""
    request = GenerationRequest(request_id, prompt, PARAMS)
    reservation = decode.reserve(request)
    assert reservation.granted, reservation.reason
    items = list(prefill.prefill(request, HandoffTarget.from_reservation(reservation, 6)))
    result = items[-1]
    assert isinstance(result, HandoffResult) and result.ok, result
    events = [i for i in items if isinstance(i, TokenEvent)] + list(decode.stream(request_id))
    assert events[-1].finish_reason == FinishReason.LENGTH
    return reservation, result, events


def test_a_shared_prefix_moves_only_the_new_blocks(pair, tiny_loaded):
    prefill, decode = pair
    block_bytes = bytes_per_block(prefill.engine.shape, 4, torch.float32)
    first_prompt, second_prompt = [*SYSTEM, 1, 2], [*SYSTEM, 1, 2, 3, 4, 5]
    first, first_result, _ = _handoff(prefill, decode, "first", first_prompt)
    assert first.num_cached_blocks == 0
    assert first_result.num_bytes == 7 * block_bytes  # 28 prompt tokens: all seven blocks
    second, second_result, events = _handoff(prefill, decode, "second", second_prompt)
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
    prefill = PrefillWorker(_config(tiny_model_dir, prefix_caching=False), transfer)
    decode = DecodeWorker(_config(tiny_model_dir, prefix_caching=False), transfer)
    try:
        block_bytes = bytes_per_block(prefill.engine.shape, 4, torch.float32)
        _handoff(prefill, decode, "first", [*SYSTEM, 1, 2])
        second, result, events = _handoff(prefill, decode, "second", [*SYSTEM, 1, 2, 3, 4, 5])
        assert second.num_cached_blocks == 0 and result.num_bytes == 8 * block_bytes
        assert {e.num_cached_tokens for e in events} == {0}
    finally:
        for worker in (prefill, decode):
            worker.loop.stop()
        decode.receiver.close()
        prefill.sender.close()


def test_pages_that_start_at_the_wrong_block_are_refused(tiny_model_dir):
    """A sender that ignores the reservation's cached blocks (or forges a start) is refused,
    and both sides free everything."""
    transfer = KVTransferConfig("zmq", shared_memory=False, transfer_timeout_s=5.0)
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    try:
        _handoff(prefill, decode, "first", [*SYSTEM, 1, 2])
        request = GenerationRequest("second", [*SYSTEM, 1, 2, 3], PARAMS)
        reservation = decode.reserve(request)
        assert reservation.num_cached_blocks == 7
        target = HandoffTarget(reservation.endpoint, 6, reservation.token, first_block=0)
        result = list(prefill.prefill(request, target))[-1]
        assert isinstance(result, HandoffResult) and not result.ok
        assert "leading blocks" in result.error or "blocks arrived" in result.error
        assert decode.abort("second")  # as the coordinator does after a failed hand-off
        assert decode.load().stats.num_used_blocks == 0
        deadline = time.monotonic() + 5  # prefill frees its blocks right after the result
        while prefill.load().stats.num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert prefill.load().stats.num_used_blocks == 0
    finally:
        for worker in (prefill, decode):
            worker.loop.stop()
        decode.receiver.close()
        prefill.sender.close()
