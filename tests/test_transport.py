"""KV transports over real sockets (ZMQ, gRPC) and in-process: bytes arrive bit-exact, the
handshake refuses a mismatched layout with a clear error, and a dead endpoint times out."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer import KVTransferError, create_receiver, create_sender
from engine.transfer.payload import KVLayout, KVPayload
from tests.conftest import make_engine

TRANSPORTS = ["zmq", "grpc", "inprocess"]


@pytest.fixture
def payload(tiny_loaded) -> KVPayload:
    engine = make_engine(tiny_loaded, block_size=4)
    engine.add_request(
        "r1", list(range(3, 40)), SamplingParams(max_new_tokens=5, seed=11), prefill_only=True
    )
    while engine.requests["r1"].status != RequestStatus.HELD:
        engine.step()
    payload = engine.export_kv("r1")
    payload.state.max_output_tokens = 5
    return payload


class Recorder:
    def __init__(self, expected: KVLayout) -> None:
        self.expected = expected
        self.received: list[KVPayload] = []

    def __call__(self, item):
        if isinstance(item, KVLayout):
            try:
                self.expected.check_compatible(item)
            except Exception as exc:
                return str(exc)
            return None
        self.received.append(KVPayload(item.layout, item.state, item.blocks.clone()))
        return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pages_and_state_arrive_bit_exact(transport, payload):
    recorder = Recorder(payload.layout)
    receiver = create_receiver(transport, recorder)
    sender = create_sender(transport)
    try:
        for _ in range(3):  # the reused receive buffer must not leak one transfer into the next
            sender.send(receiver.endpoint, payload, timeout=10)
    finally:
        sender.close()
        receiver.close()
    assert len(recorder.received) == 3
    for got in recorder.received:
        assert torch.equal(got.blocks, payload.blocks)
        assert got.blocks.dtype == payload.blocks.dtype
        assert got.layout == payload.layout
        assert got.state == payload.state


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_payload_crosses_in_chunks(transport, payload):
    big = KVPayload(payload.layout, payload.state, torch.randn(3, 2, 40, 64, 4, 64))  # 15 MiB
    recorder = Recorder(payload.layout)
    receiver, sender = create_receiver(transport, recorder), create_sender(transport)
    try:
        sender.send(receiver.endpoint, big, timeout=20)
    finally:
        sender.close()
        receiver.close()
    assert torch.equal(recorder.received[0].blocks, big.blocks)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "field, value",
    [("block_size", 16), ("dtype", "torch.float16"), ("model_fingerprint", "another-model")],
)
def test_handshake_mismatch_is_refused_with_a_clear_error(transport, payload, field, value):
    receiver_layout = dataclasses.replace(payload.layout, **{field: value})
    recorder = Recorder(receiver_layout)
    receiver, sender = create_receiver(transport, recorder), create_sender(transport)
    try:
        with pytest.raises(KVTransferError, match=f"incompatible KV cache: {field}"):
            sender.send(receiver.endpoint, payload, timeout=10)
    finally:
        sender.close()
        receiver.close()
    assert recorder.received == []


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_dead_endpoint_times_out(transport, payload):
    receiver = create_receiver(transport, Recorder(payload.layout))
    endpoint = receiver.endpoint
    receiver.close()
    sender = create_sender(transport)
    start = time.monotonic()
    with pytest.raises(KVTransferError):
        sender.send(endpoint, payload, timeout=1.0)
    assert time.monotonic() - start < 5
    sender.close()


def test_unknown_transport_name_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_transport must be one of zmq, grpc, inprocess"):
        create_sender("rdma")


def test_zmq_uses_shared_memory_on_one_host_and_frames_when_it_cannot(payload, monkeypatch):
    from engine.transfer import shared_memory
    from engine.transfer.zmq_transport import ZmqKVSender

    recorder = Recorder(payload.layout)
    receiver, sender = create_receiver("zmq", recorder), ZmqKVSender()
    try:
        sender.send(receiver.endpoint, payload, timeout=10)
        assert sender._shared[receiver.endpoint] is not None  # went through /dev/shm
        assert not sender._shared[receiver.endpoint].path.exists()  # the receiver unlinked it

        def unreachable(self, path, num_bytes):
            raise OSError("another host")

        monkeypatch.setattr(shared_memory.SharedPageReader, "view", unreachable)
        other = create_receiver("zmq", recorder)
        sender.send(other.endpoint, payload, timeout=10)
        assert sender._shared[other.endpoint] is None  # fell back to frames for good
        sender.send(other.endpoint, payload, timeout=10)
        other.close()
    finally:
        sender.close()
        receiver.close()
    assert len(recorder.received) == 3
    assert all(torch.equal(got.blocks, payload.blocks) for got in recorder.received)
