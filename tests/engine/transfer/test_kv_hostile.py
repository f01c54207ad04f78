"""A decode worker's KV receiver under hostile senders, over real ZMQ and gRPC sockets: malformed,
oversized, forged or unauthorised transfers and shared-memory tricks are each refused (or dropped
by the transport) before anything is sized by them or reaches the engine, refusals reveal
nothing about the receiver, and the next good hand-off still goes through and decodes."""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from engine.request import RequestStatus
from engine.transfer import shared_memory as shm
from engine.transfer.codec import encode_header
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from engine.transfer.transports import create_sender
from tests.support.kv_pairs import (
    REFUSAL,
    Pair,
    _exported,
    _forgeries,
    _hostile_name,
    _raw_send,
    _refused,
    _request,
    _send_payload,
    _send_transfer,
    _shm_header,
)


@pytest.fixture(params=["zmq", "grpc"])
def pair(request, tiny_model_dir) -> Iterator[Pair]:
    workers = Pair(tiny_model_dir, request.param, shared_memory=False)
    yield workers
    workers.close()


@pytest.fixture
def shm_pair(tiny_model_dir) -> Iterator[Pair]:
    workers = Pair(tiny_model_dir, "zmq", shared_memory=True)
    yield workers
    workers.close()


def test_garbage_is_refused_and_the_receiver_goes_on(pair):
    if pair.transport == "zmq":
        ack = _raw_send("zmq", pair.endpoint, [b"\xff\xff not a header", b"x"])
        _refused(ack, "malformed transfer")
    else:
        error = _raw_send("grpc", pair.endpoint, [b"\xff\xff not a chunk"])
        assert isinstance(error, grpc.RpcError)
    header = pb.KVHeaderMsg()
    header.layout.dtype = "torch.complex128"
    header.shape.extend([2, 2, 1, 4, 2, 8])
    _refused(_send_transfer(pair, header, b""), "malformed transfer")
    pair.good_handoff("good")


def test_a_huge_declared_size_is_never_allocated(pair, tiny_loaded, monkeypatch):
    reservation = pair.decode.reserve(_request("r"))
    payload = _exported(tiny_loaded, "r", reservation.token)
    sizes: list[int] = []
    empty = torch.empty

    def recording_empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        sizes.append(int(size[0]) if size and isinstance(size[0], int) else 0)
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    header = encode_header(payload)
    header.shape[2] = 2**30  # consistent with itself: 2**30 blocks
    header.num_bytes = header.num_bytes // len(payload.blocks[0, 0]) * 2**30
    _refused(_send_transfer(pair, header, b""), "exceed")
    header.num_bytes = 2**50  # at odds with its shape
    _refused(_send_transfer(pair, header, b""), "malformed transfer")
    assert max(sizes, default=0) <= pair.decode.engine.kv_cache_bytes
    monkeypatch.undo()
    assert pair.status("r") == RequestStatus.RESERVED
    pair.good_handoff("r", reservation)


def test_a_message_larger_than_the_cache_is_dropped_by_the_transport(pair):
    oversized = b"\0" * (pair.decode.engine.kv_cache_bytes + 20 * 2**20)
    if pair.transport == "zmq":
        assert _raw_send("zmq", pair.endpoint, [oversized], timeout_s=1.0) is None
    else:
        chunk = pb.KVChunkMsg(data=oversized).SerializeToString()
        # The refusal comes from the length prefix; the deadline only has to outlast a loaded
        # machine serializing and starting to write the oversized chunk.
        error = _raw_send("grpc", pair.endpoint, [chunk], timeout_s=60.0)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    pair.good_handoff("good")


def test_grpc_chunks_beyond_the_declared_size_are_refused(tiny_model_dir, tiny_loaded):
    pair = Pair(tiny_model_dir, "grpc", shared_memory=False)
    try:
        reservation = pair.decode.reserve(_request("r"))
        payload = _exported(tiny_loaded, "r", reservation.token)
        pages = payload.blocks.view(torch.uint8).numpy().tobytes()
        first = pb.KVChunkMsg(header=encode_header(payload), data=pages)
        empty = pb.KVChunkMsg().SerializeToString()
        ack = _raw_send("grpc", pair.endpoint, [first.SerializeToString()] + [empty] * 1000)
        _refused(ack, "more bytes or chunks than declared")
        deadline = time.monotonic() + 5
        while pair.status("r") is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pair.status("r") is None  # its pages will not come: the reservation ended
        pair.good_handoff("good")
    finally:
        pair.close()


def test_reservations_carry_distinct_128_bit_secrets(pair):
    first, second = pair.decode.reserve(_request("a")), pair.decode.reserve(_request("b"))
    assert len(bytes.fromhex(first.token)) == 16 and len(bytes.fromhex(second.token)) == 16
    assert first.token != second.token
    assert first.token not in repr(first)


def test_pages_without_the_reservations_secret_are_refused(pair, tiny_loaded):
    reservation = pair.decode.reserve(_request("r"))
    for token in ("", "0" * 32, reservation.token[:-1] + "x", "é" * 32):
        error = _refused(_send_payload(pair, _exported(tiny_loaded, "r", token)))
        assert error == REFUSAL
    stranger = _exported(tiny_loaded, "r", "0" * 32)
    stranger.layout = dataclasses.replace(stranger.layout, model_fingerprint="probe")
    assert _refused(_send_payload(pair, stranger)) == REFUSAL  # no layout is compared for it
    unknown = _exported(tiny_loaded, "nobody", reservation.token)
    assert _refused(_send_payload(pair, unknown)) == REFUSAL
    assert pair.status("r") == RequestStatus.RESERVED
    pair.good_handoff("r", reservation)


def test_a_layout_refusal_never_echoes_the_model_fingerprint(pair, tiny_loaded):
    reservation = pair.decode.reserve(_request("r"))
    payload = _exported(tiny_loaded, "r", reservation.token)
    payload.layout = dataclasses.replace(payload.layout, model_fingerprint="another-model")
    error = _refused(_send_payload(pair, payload), "incompatible KV cache", "model_fingerprint")
    assert pair.decode.engine.layout.model_fingerprint not in error
    assert "another-model" not in error
    pair.good_handoff("r", reservation)


def test_a_forged_sender_cutting_its_stream_does_not_end_the_reservation(tiny_model_dir):
    pair = Pair(tiny_model_dir, "grpc", shared_memory=False)
    try:
        reservation = pair.decode.reserve(_request("r"))
        header = pb.KVHeaderMsg()
        header.state.request_id = "r"
        header.layout.CopyFrom(pb.KVLayoutMsg(**pair.decode.engine.layout.to_dict()))
        header.shape.extend([1, 2, 2, 4, 1, 1])
        header.num_bytes = 64
        release = threading.Event()

        def chunks() -> Iterator[pb.KVChunkMsg]:
            yield pb.KVChunkMsg(header=header)
            release.wait(5)

        with grpc.insecure_channel(pair.endpoint) as channel:
            call = pb_grpc.KVTransferStub(channel).Push.future(chunks(), timeout=5)
            time.sleep(0.3)
            call.cancel()
            release.set()
        time.sleep(0.3)
        assert pair.status("r") == RequestStatus.RESERVED
        pair.good_handoff("r", reservation)
    finally:
        pair.close()


def test_forged_states_never_reach_the_engine(pair, tiny_loaded):
    reservation = pair.decode.reserve(_request("r"))
    running = pair.decode.reserve(_request("bystander"))
    vocab_size = pair.decode.engine.shape.vocab_size
    for name, forge in _forgeries(vocab_size).items():
        payload = _exported(tiny_loaded, "r", reservation.token)
        forge(payload)
        _refused(_send_payload(pair, payload))
        assert pair.status("r") == RequestStatus.RESERVED, name
    pair.good_handoff("bystander", running)
    pair.good_handoff("r", reservation)


def test_hostile_shared_memory_names_and_files_are_refused(shm_pair, tiny_loaded, tmp_path):
    reservation = shm_pair.decode.reserve(_request("r"))
    payload = _exported(tiny_loaded, "r", reservation.token)
    secret = tmp_path / "secret"
    secret.write_bytes(b"\1" * payload.num_bytes)
    hostile: list[tuple[str, Callable[[], str]]] = [
        ("a path", lambda: str(secret)),
        ("a traversal", lambda: f"pdserve-kv-1-{'0' * 32}/../../../{secret}"),
        ("a name out of pattern", lambda: "pdserve-kv-1-../../etc/passwd"),
    ]
    fifo, link, short = _hostile_name(), _hostile_name(), _hostile_name()
    os.mkfifo(shm.SHM_DIR / fifo, 0o600)
    os.symlink(secret, shm.SHM_DIR / link)
    (shm.SHM_DIR / short).write_bytes(b"\1" * (payload.num_bytes - 1))
    hostile += [
        ("a FIFO", lambda: fifo),
        ("a symlink", lambda: link),
        ("a short file", lambda: short),
    ]
    try:
        for what, name in hostile:
            start = time.monotonic()
            ack = _raw_send("zmq", shm_pair.endpoint, [_shm_header(payload, name())])
            _refused(ack, "shared memory unavailable")
            assert time.monotonic() - start < 2, what
        assert secret.exists() and (shm.SHM_DIR / link).is_symlink()
    finally:
        for name in (fifo, link, short):
            (shm.SHM_DIR / name).unlink(missing_ok=True)
    assert shm_pair.status("r") == RequestStatus.RESERVED
    shm_pair.good_handoff("r", reservation)
    assert shm_pair.prefill.num_handoffs_by_path() == {"shared_memory": 1}


def test_sender_files_are_new_private_and_randomly_named(monkeypatch, tmp_path):
    buffer = shm.SharedPageBuffer(4096)
    try:
        assert shm.NAME_PATTERN.match(buffer.name) and buffer.path.parent == shm.SHM_DIR
        assert buffer.path.stat().st_mode & 0o777 == 0o600
        assert buffer.name != shm.new_name()
    finally:
        buffer.close()
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    planted = _hostile_name()
    os.symlink(target, shm.SHM_DIR / planted)
    monkeypatch.setattr(shm, "new_name", lambda: planted)
    try:
        with pytest.raises(FileExistsError):
            shm.SharedPageBuffer(4096)
        assert target.read_bytes() == b"keep"
    finally:
        (shm.SHM_DIR / planted).unlink()


def test_a_full_dev_shm_falls_back_to_frames(shm_pair, monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*"))
    monkeypatch.setattr(os, "posix_fallocate", full)
    shm_pair.good_handoff("r")
    assert shm_pair.prefill.num_handoffs_by_path() == {"frames": 1}
    assert set(shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*")) == before
    monkeypatch.undo()
    first_sender = shm_pair.prefill.sender
    shm_pair.prefill.sender = create_sender("zmq")  # a fresh one, with room now: shared memory
    try:
        shm_pair.good_handoff("next")
        assert shm_pair.prefill.num_handoffs_by_path() == {"shared_memory": 1}
    finally:
        first_sender.close()
