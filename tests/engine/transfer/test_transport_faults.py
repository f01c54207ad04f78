"""Transports under faults, over real ZMQ and gRPC sockets: a transfer broken mid-stream (fault
injection) fails the hand-off within the transfer timeout and frees both sides; idle or stalled
gRPC clients cannot hold the receiver; dead endpoints fail in time and keep nothing open."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
import zmq

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.transfer.base import KVTransferError, ReceiverLimits
from engine.transfer.endpoints import EndpointCache
from engine.transfer.grpc_transport import MAX_CONCURRENT_PUSHES, chunk_messages
from engine.transfer.payload import HandoffState, KVLayout, KVPayload, TransferHeader
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from engine.transfer.transports import create_receiver, create_sender
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import OWNER, ChannelReader
from tests.support.inprocess_workers import _stop
from tests.support.transport_recorder import num_connections
from tests.support.worker_streams import wait_until as _wait_until
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget
from workers.faults import FAULT_INJECTION_ENV

# a hand-off's settings (transport, shared_memory)
SOCKETS = {"zmq_shm": ("zmq", True), "zmq_frames": ("zmq", False), "grpc": ("grpc", True)}
TRANSFER_TIMEOUT_S = 1.0


def _config(model_dir) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=64)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


def _request(request_id: str) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    return GenerationRequest(request_id, range(5, 10), params, owner=OWNER)


@pytest.fixture(params=list(SOCKETS))
def pair(request, tiny_model_dir, monkeypatch):
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    transport, shared_memory = SOCKETS[request.param]
    transfer = KVTransferConfig(
        transport,
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
        reservation_timeout_s=60.0,  # never what frees the blocks here
        shared_memory=shared_memory,
    )
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    reader = ChannelReader(prefill, decode)
    yield prefill, decode, reader
    reader.close()
    _stop(prefill, decode)


def _used(worker: Any) -> int:
    return worker.load().stats.num_used_blocks


# ---- fault injection ---------------------------------------------------------------------------


def test_fault_injection_needs_its_environment_switch(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(FAULT_INJECTION_ENV, raising=False)
    decode = DecodeWorker(_config(tiny_model_dir), KVTransferConfig("inprocess"))
    try:
        with pytest.raises(RuntimeError, match="PDSERVE_FAULT_INJECTION=1"):
            decode.inject_fault("break_transport")
        monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
        with pytest.raises(ValueError, match="unknown fault 'drop_disk'"):
            decode.inject_fault("drop_disk")
        assert decode.inject_fault("break_transport", 2) == 2
        assert decode.inject_fault("break_transport") == 3
    finally:
        _stop(decode)


def test_a_transport_broken_mid_transfer_fails_the_handoff_and_frees_both_sides(pair):
    prefill, decode, reader = pair
    reservation = decode.reserve(_request("broken"))
    assert reservation.granted
    assert decode.inject_fault("break_transport", 1) == 1
    start = time.monotonic()
    target = HandoffTarget.from_reservation(reservation, 6)
    assert prefill.prefill(_request("broken"), target).accepted
    items = reader.items(prefill, "broken")
    seconds = time.monotonic() - start
    result = items[-1]
    assert isinstance(result, HandoffResult) and not result.ok
    assert result.error.startswith("KV hand-off failed")
    assert seconds < TRANSFER_TIMEOUT_S + 1.0
    assert _wait_until(lambda: _used(prefill) == 0, 3)
    assert _wait_until(lambda: _used(decode) == 0, 3)  # not left to the 60 s expiry
    [event] = reader.items(decode, "broken")
    assert event.finish_reason == FinishReason.ERROR and "KV transfer broke" in event.error
    assert decode.load().num_open_streams == 0

    # the transport recovers: the next hand-off goes through
    reservation = decode.reserve(_request("next"))
    assert reservation.granted
    target = HandoffTarget.from_reservation(reservation, 6)
    assert prefill.prefill(_request("next"), target).accepted
    assert reader.items(prefill, "next")[-1].ok
    events = reader.items(decode, "next")
    assert events[-1].finish_reason == FinishReason.LENGTH
    assert num_connections(prefill.sender) == 1
    assert _used(decode) == 0 and decode.load().num_open_streams == 0


# ---- dead endpoints ----------------------------------------------------------------------------

_LAYOUT = KVLayout("fp", "layer,kv,block,slot,kv_head,head_dim", "torch.float32", 4, 2, 2, 8)
_STATE = HandoffState("r", [1, 2, 3], 3, 3, SamplingParams(), 5, 2)


def _payload(num_blocks: int = 1) -> KVPayload:
    return KVPayload(_LAYOUT, _STATE, torch.randn(2, 2, num_blocks, 4, 2, 8))


def _accept_all(item: TransferHeader | KVPayload) -> str | None:
    return None


@pytest.mark.parametrize("handoff", list(SOCKETS))
def test_senders_to_dead_receivers_fail_in_time_and_keep_nothing_open(handoff):
    transport, shared_memory = SOCKETS[handoff]
    sender = create_sender(transport, shared_memory)
    try:
        for _ in range(5):  # a decode worker restarting on a new port each time
            receiver = create_receiver(transport, _accept_all)
            sender.send(receiver.endpoint, _payload(), timeout=5)
            receiver.close()  # the process died
            start = time.monotonic()
            with pytest.raises(KVTransferError):
                sender.send(receiver.endpoint, _payload(), timeout=0.5)
            assert time.monotonic() - start < 0.5 + 0.5
            assert num_connections(sender) == 0
    finally:
        sender.close()


def test_idle_connections_are_closed():
    closed: list[str] = []
    cache: EndpointCache[str] = EndpointCache(lambda e: e, closed.append, idle_s=0.1)
    with cache.lease("a"):
        pass
    with cache.lease("b") as b:
        time.sleep(0.2)
        with cache.lease("c"):  # "a" has been idle for 0.2 s; "b" is in use
            assert closed == ["a"]
        cache.discard("b", b)
        assert closed == ["a"]  # closed once its transfer is over
    assert closed == ["a", "b"] and len(cache) == 1
    cache.close()
    assert closed == ["a", "b", "c"] and len(cache) == 0


def test_a_malformed_zmq_message_is_refused_and_the_receiver_goes_on():
    receiver = create_receiver("zmq", _accept_all)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(receiver.endpoint)
    sender = create_sender("zmq", False)
    try:
        raw.send_multipart([b"\xff\xff not a header", b"x"])
        assert raw.poll(5000)
        ack = pb.KVAckMsg()
        ack.ParseFromString(raw.recv())
        assert not ack.ok and ack.error.startswith("malformed transfer")
        sender.send(receiver.endpoint, _payload(), timeout=5)
    finally:
        raw.close(0)
        sender.close()
        receiver.close()


# ---- gRPC: bounded concurrency and stream deadlines -------------------------------------------


class _RawClient:
    """Pushes that send ``first`` (if any), then nothing until released."""

    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.KVTransferStub(self.channel)
        self.release = threading.Event()

    def stalled_push(self, first: pb.KVChunkMsg | None = None) -> grpc.Future:
        def chunks() -> Iterator[pb.KVChunkMsg]:
            if first is not None:
                yield first
            self.release.wait(30)

        return self.stub.Push.future(chunks())

    def close(self) -> None:
        self.release.set()
        self.channel.close()


def test_idle_grpc_streams_do_not_block_a_handoff_beyond_the_stream_bound():
    receiver = create_receiver("grpc", _accept_all, limits=ReceiverLimits(stream_timeout_s=1.0))
    raw = _RawClient(receiver.endpoint)
    sender = create_sender("grpc")
    try:
        idle = [raw.stalled_push() for _ in range(MAX_CONCURRENT_PUSHES)]
        time.sleep(0.2)  # every receiver thread is taken
        with pytest.raises(grpc.RpcError) as refused:  # one more is refused at once
            raw.stub.Push(iter(list(chunk_messages(_payload()))), timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        start = time.monotonic()
        sender.send(receiver.endpoint, _payload(), timeout=5)  # waits for a free thread
        assert time.monotonic() - start < 1.0 + 1.0
        for push in idle:
            assert push.exception(timeout=5).code() == grpc.StatusCode.CANCELLED
    finally:
        raw.close()
        sender.close()
        receiver.close()


def test_a_grpc_stream_stalling_mid_transfer_is_cut_and_reported():
    broken: list[tuple[str, str]] = []
    receiver = create_receiver(
        "grpc",
        _accept_all,
        on_broken=lambda *why: broken.append(why),
        limits=ReceiverLimits(stream_timeout_s=0.5),
    )
    raw = _RawClient(receiver.endpoint)
    try:
        payload = KVPayload(_LAYOUT, _STATE, torch.randn(2, 2, 2**13, 4, 2, 8))  # 8 MiB
        first = next(chunk_messages(payload))  # header and the first 4 MiB, then nothing
        start = time.monotonic()
        push = raw.stalled_push(first)
        assert push.exception(timeout=5).code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - start < 0.5 + 1.0
        assert _wait_until(lambda: bool(broken), 2)
        assert broken[0][0] == "r"
        assert receiver.payloads_by_path.as_dict() == {}
    finally:
        raw.close()
        receiver.close()
