"""KV transports over real sockets (ZMQ, gRPC) and in-process: bytes arrive bit-exact, the
handshake refuses a mismatched layout with a clear error, and a dead endpoint times out. ZMQ runs
both ways: through ``/dev/shm`` (same host) and with every page on the socket (as between hosts);
each test checks the path the pages actually took."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import pytest
import torch

from engine.config import KVTransferConfig
from engine.errors import ConfigError
from engine.transfer.base import KVTransferError
from engine.transfer.grpc_transport import CHUNK_BYTES, chunk_messages
from engine.transfer.transports import create_receiver, create_sender
from tests.support.transport_recorder import (
    HANDOFFS,
    SOCKETS,
    Recorder,
    _assert_path,
    _pages,
    _pair,
)


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_pages_and_state_arrive_bit_exact(handoff, payload):
    recorder = Recorder(payload.layout)
    receiver, sender = _pair(handoff, recorder)
    try:
        for _ in range(3):  # a reused buffer or file must not leak one transfer into the next
            sender.send(receiver.endpoint, payload, timeout=10)
        _assert_path(handoff, sender, receiver, 3)
    finally:
        sender.close()
        receiver.close()
    assert len(recorder.received) == 3
    for got in recorder.received:
        assert torch.equal(got.blocks, payload.blocks)
        assert got.blocks.dtype == payload.blocks.dtype
        assert got.layout == payload.layout
        assert got.state == payload.state


@pytest.mark.parametrize("handoff", HANDOFFS)
def test_payloads_that_grow_then_shrink_arrive_bit_exact(handoff, payload):
    """Several MiB, more (the receive buffer, or the shared file, is replaced by a larger one),
    then less (the larger one is reused): each in several gRPC chunks, or one ZMQ frame."""
    sizes = [96, 160, 12]  # blocks of 128 KiB: 12 MiB, 20 MiB, 1.5 MiB
    payloads = [_pages(payload, n) for n in sizes]
    assert payloads[0].num_bytes == 12 * 2**20 and payloads[1].num_bytes == 20 * 2**20
    recorder = Recorder(payload.layout)
    receiver, sender = _pair(handoff, recorder)
    try:
        for sent in payloads:
            sender.send(receiver.endpoint, sent, timeout=20)
        _assert_path(handoff, sender, receiver, len(payloads))
    finally:
        sender.close()
        receiver.close()
    for got, sent in zip(recorder.received, payloads, strict=True):
        assert torch.equal(got.blocks, sent.blocks)


def test_grpc_streams_the_pages_in_chunks_of_at_most_4_mib(payload):
    big = _pages(payload, 160)  # 20 MiB
    chunks = list(chunk_messages(big))
    assert len(chunks) == math.ceil(big.num_bytes / CHUNK_BYTES) == 5
    assert [len(c.data) for c in chunks] == [CHUNK_BYTES] * 5
    assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
    assert b"".join(c.data for c in chunks) == big.blocks.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("handoff", HANDOFFS)
@pytest.mark.parametrize(
    "field, value",
    [("block_size", 16), ("dtype", "torch.float16"), ("model_fingerprint", "another-model")],
)
def test_handshake_mismatch_is_refused_with_a_clear_error(handoff, payload, field, value):
    receiver_layout = dataclasses.replace(payload.layout, **{field: value})
    recorder = Recorder(receiver_layout)
    receiver, sender = _pair(handoff, recorder)
    try:
        with pytest.raises(KVTransferError, match=f"incompatible KV cache: {field}"):
            sender.send(receiver.endpoint, payload, timeout=10)
        _assert_path(handoff, sender, receiver, 0)
    finally:
        sender.close()
        receiver.close()
    assert recorder.received == []


@pytest.mark.parametrize("handoff", SOCKETS)
def test_dead_endpoint_times_out(handoff, payload):
    receiver, sender = _pair(handoff, Recorder(payload.layout))
    endpoint = receiver.endpoint
    receiver.close()
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

    recorder = Recorder(payload.layout)
    receiver, sender = create_receiver("zmq", recorder), create_sender("zmq")
    try:
        sender.send(receiver.endpoint, payload, timeout=10)
        assert receiver.payloads_by_path.as_dict() == {"shared_memory": 1}
        assert not list(shared_memory.SHM_DIR.glob(f"pdserve-kv-{os.getpid()}-*"))  # unlinked

        def unreachable(self, path, num_bytes):
            raise OSError("another host")

        monkeypatch.setattr(shared_memory.SharedPageReader, "view", unreachable)
        other = create_receiver("zmq", recorder)
        sender.send(other.endpoint, payload, timeout=10)
        sender.send(other.endpoint, payload, timeout=10)
        assert other.payloads_by_path.as_dict() == {"frames": 2}  # fell back for good
        other.close()
    finally:
        sender.close()
        receiver.close()
    assert sender.payloads_by_path.as_dict() == {"shared_memory": 1, "frames": 2}
    assert len(recorder.received) == 3
    assert all(torch.equal(got.blocks, payload.blocks) for got in recorder.received)


def test_shared_memory_is_chosen_by_the_config(tmp_path):
    from coordinator.config.loader import load_config
    from coordinator.served_model import ServedModels, cluster_config

    assert KVTransferConfig().shared_memory
    with pytest.raises(ConfigError, match="kv_shared_memory must be true or false, got 'no'"):
        KVTransferConfig("zmq", shared_memory="no")  # type: ignore[arg-type]
    no_models = ServedModels(generation=None, embedding_path=None)
    path = tmp_path / "config.json"
    for value in (True, False):
        path.write_text(json.dumps({"backend_config": {"kv_shared_memory": value}}))
        assert cluster_config(load_config(path), no_models).kv.shared_memory is value
    path.write_text(json.dumps({"backend_config": {"kv_shared_memory": "no"}}))
    with pytest.raises(ConfigError, match="backend_config.kv_shared_memory must be true or false"):
        load_config(path)
