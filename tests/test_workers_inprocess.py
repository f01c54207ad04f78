"""Worker classes driven in-process (no Ray): hand-off over the real transports, and the
failure paths that must free blocks on both sides."""

from __future__ import annotations

import time

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.worker_runtime import HandoffResult
from prefill_worker.worker import PrefillWorker


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=64)
    )


@pytest.fixture(params=["zmq", "grpc", "inprocess"])
def pair(request, tiny_model_dir):
    prefill = PrefillWorker(
        _config(tiny_model_dir), kv_transport=request.param, transfer_timeout_s=1.0
    )
    decode = DecodeWorker(
        _config(tiny_model_dir), kv_transport=request.param, reservation_timeout_s=1.0
    )
    yield prefill, decode
    for worker in (prefill, decode):
        worker.loop.stop()
    decode.receiver.close()
    prefill.sender.close()


def _used(worker) -> int:
    load = worker.load()
    return load["num_total_blocks"] - load["num_free_blocks"]


def test_handoff_then_decode(pair):
    prefill, decode = pair
    params = SamplingParams(max_new_tokens=6, ignore_eos=True).to_dict()
    assert decode.reserve("r", 5)["ok"]
    items = list(prefill.prefill("r", [5, 6, 7, 8, 9], params, 5, decode.endpoint(), 6))
    assert isinstance(items[0], TokenEvent) and items[0].token_id is not None
    assert isinstance(items[-1], HandoffResult) and items[-1].ok and items[-1].num_bytes > 0
    events = list(decode.stream("r"))
    assert len(events) == 5 and events[-1].finish_reason == FinishReason.LENGTH
    assert _used(prefill) == 0 and _used(decode) == 0


def test_transfer_to_a_dead_endpoint_frees_the_prefill_blocks(pair, tiny_model_dir):
    prefill, decode = pair
    params = SamplingParams(max_new_tokens=6, ignore_eos=True).to_dict()
    dead = {"zmq": "tcp://127.0.0.1:9", "grpc": "127.0.0.1:9", "inprocess": "inprocess://gone"}
    transport = type(decode.receiver).__name__.lower()
    endpoint = next(v for k, v in dead.items() if k in transport)
    start = time.monotonic()
    items = list(prefill.prefill("r", [5, 6, 7, 8, 9], params, 5, endpoint, 6))
    assert isinstance(items[-1], HandoffResult) and not items[-1].ok
    assert "KV hand-off failed" in items[-1].error
    assert time.monotonic() - start < 5
    assert _used(prefill) == 0


def test_pages_that_never_arrive_free_the_reservation(pair):
    _, decode = pair
    assert decode.reserve("lost", 20)["ok"]
    assert _used(decode) > 0
    events = list(decode.stream("lost"))  # ends when the reservation expires (1 s here)
    assert events[-1].finish_reason == FinishReason.ERROR
    assert "did not arrive" in events[-1].error
    assert _used(decode) == 0


def test_abort_before_the_pages_arrive_refuses_them(pair):
    prefill, decode = pair
    params = SamplingParams(max_new_tokens=6, ignore_eos=True).to_dict()
    assert decode.reserve("r", 5)["ok"]
    decode.abort("r")
    items = list(prefill.prefill("r", [5, 6, 7, 8, 9], params, 5, decode.endpoint(), 6))
    assert isinstance(items[-1], HandoffResult) and not items[-1].ok
    assert "no reservation" in items[-1].error
    assert _used(prefill) == 0 and _used(decode) == 0


def test_full_decode_worker_grants_waiting_handoffs_by_priority(tiny_model_dir):
    import threading

    config = EngineConfig(
        model_path=str(tiny_model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=4)
    )
    decode = DecodeWorker(config, kv_transport="inprocess")
    try:
        assert decode.reserve("hog", 12)["ok"]  # every block
        granted: list[str] = []

        def wait(request_id: str, priority: int) -> None:  # 5 + 1 tokens = 2 of the 4 blocks
            if decode.reserve(request_id, 5, wait_s=3, priority=priority)["ok"]:
                granted.append(request_id)

        threads = []
        for request_id, priority in [("p5-first", 5), ("p5-second", 5), ("p1-late", 1)]:
            threads.append(threading.Thread(target=wait, args=(request_id, priority)))
            threads[-1].start()
            time.sleep(0.2)
        decode.abort("hog")  # frees 4 blocks: room for two of the three waiting hand-offs
        for thread in threads:
            thread.join(timeout=10)
        assert sorted(granted) == ["p1-late", "p5-first"]  # the later priority-5 one waits
    finally:
        decode.loop.stop()
        decode.receiver.close()
