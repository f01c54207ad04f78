"""What the KV plane bounds, over real sockets: a plaintext plane off loopback is refused at
start (allowed only explicitly, and then warned about); a header frame past the receiver's limit
is refused unparsed; pages travel in bounded frames, a larger frame is dropped by ZMQ and a
message with more frames than its header announced is refused and ends its reservation; the
decode worker's output limit and cached-token count are its reservation's, not the wire's."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time

import pytest
import torch

from coordinator.config.cluster import ClusterConfig
from coordinator.config.loader import load_config
from engine.config import KVTransferConfig
from engine.errors import ConfigError
from engine.request import RequestStatus
from engine.transfer.base import PAGE_FRAME_BYTES, header_limit
from engine.transfer.codec import encode_header
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.security import transfer_credentials
from engine.transfer.transports import create_sender
from tests.support.kv_pairs import PROMPT, Pair, _exported, _raw_send, _refused, _request

OFF_LOOPBACK = {"kv_encryption": "off", "kv_host": "10.0.0.7"}


# ---- plaintext off loopback ---------------------------------------------------------------------


def test_a_plaintext_kv_plane_off_loopback_is_refused_at_config_load(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"backend_config": OFF_LOOPBACK}))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    for fragment in ("kv_encryption 'off'", "'10.0.0.7'", "kv_allow_plaintext_off_loopback"):
        assert fragment in str(error.value)
    with pytest.raises(ConfigError, match="not a loopback address"):
        ClusterConfig(kv=KVTransferConfig("zmq", "auto", encryption="off"))  # the node's IP
    allowed = {**OFF_LOOPBACK, "kv_allow_plaintext_off_loopback": True}
    path.write_text(json.dumps({"backend_config": allowed}))
    load_config(path)
    for host in ("127.0.0.1", "localhost", "::1"):  # loopback stays allowed as it was
        assert not KVTransferConfig("zmq", host, encryption="off").encrypted
    assert not KVTransferConfig("inprocess", "10.0.0.7", encryption="off").encrypted


def test_an_allowed_plaintext_plane_off_loopback_is_warned_about_by_each_worker(caplog):
    allowed = KVTransferConfig(
        "zmq", "10.0.0.7", encryption="off", allow_plaintext_off_loopback=True
    )
    with caplog.at_level(logging.WARNING, logger="engine.transfer.security"):
        assert transfer_credentials(allowed, None) is None  # what each worker calls at start
        transfer_credentials(KVTransferConfig("zmq", encryption="off"), None)  # loopback: quiet
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PLAIN TEXT" in warnings[0] and "10.0.0.7" in warnings[0]


# ---- headers and frames -------------------------------------------------------------------------


@pytest.fixture(params=["zmq", "grpc"])
def pair(request, tiny_model_dir):
    workers = Pair(tiny_model_dir, request.param, shared_memory=False)
    yield workers
    workers.close()


def _until_gone(pair: Pair, request_id: str) -> RequestStatus | None:
    deadline = time.monotonic() + 5
    while pair.status(request_id) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    return pair.status(request_id)


def test_a_header_frame_past_the_limit_is_refused_before_it_is_parsed(tiny_model_dir):
    pair = Pair(tiny_model_dir, "zmq", shared_memory=False)
    try:
        limit = header_limit(pair.decode.engine.config.scheduler.max_seq_len)
        assert pair.decode.receiver.max_header_bytes == limit
        _refused(_raw_send("zmq", pair.endpoint, [b"\xff" * (limit + 1)]), "exceeds")
        pair.good_handoff("good")
    finally:
        pair.close()


def test_a_genuine_header_padded_past_the_limit_is_refused(pair, tiny_loaded):
    reservation = pair.decode.reserve(_request("r"))
    payload = _exported(tiny_loaded, "r", reservation.token)
    header = encode_header(payload)
    header.state.params_json += " " * pair.decode.receiver.max_header_bytes  # still valid JSON
    data = payload.blocks.view(torch.uint8).numpy().tobytes()
    if pair.transport == "zmq":
        ack = _raw_send("zmq", pair.endpoint, [header.SerializeToString(), data])
    else:
        chunk = pb.KVChunkMsg(header=header, data=data).SerializeToString()
        ack = _raw_send("grpc", pair.endpoint, [chunk])
    _refused(ack, "exceeds")
    pair.good_handoff("r", reservation)  # refused unparsed: the reservation still awaits


def test_a_frame_larger_than_a_page_frame_is_dropped_by_zmq(tiny_model_dir):
    pair = Pair(tiny_model_dir, "zmq", shared_memory=False)
    try:
        assert _raw_send("zmq", pair.endpoint, [b"\0" * (2 * PAGE_FRAME_BYTES)], 1.0) is None
        pair.good_handoff("good")
    finally:
        pair.close()


def test_more_frames_than_announced_are_refused_and_free_the_reservation(
    tiny_model_dir, tiny_loaded
):
    pair = Pair(tiny_model_dir, "zmq", shared_memory=False)
    try:
        for request_id, extra in (("long", [b"x" * 1024] * 2000), ("short", [b"x"] * 2000)):
            reservation = pair.decode.reserve(_request(request_id))
            payload = _exported(tiny_loaded, request_id, reservation.token)
            frames = [encode_header(payload).SerializeToString()]
            if request_id == "long":  # the genuine pages, then an endless tail
                frames.append(payload.blocks.view(torch.uint8).numpy().tobytes())
            _refused(_raw_send("zmq", pair.endpoint, frames + extra), "malformed transfer")
            assert _until_gone(pair, request_id) is None  # its blocks are free at once
        assert pair.decode.engine.blocks.num_free_blocks == pair.decode.engine.blocks.num_blocks
        pair.good_handoff("good")
    finally:
        pair.close()


def test_pages_larger_than_a_frame_go_in_several_frames(tiny_model_dir, tiny_loaded, monkeypatch):
    from engine.transfer import zmq_transport

    monkeypatch.setattr(zmq_transport, "PAGE_FRAME_BYTES", 1000)  # the tiny pages: many frames
    pair = Pair(tiny_model_dir, "zmq", shared_memory=False)
    try:
        pair.good_handoff("split")
    finally:
        pair.close()


# ---- the reservation, not the wire --------------------------------------------------------------


def test_the_output_limit_and_cached_tokens_are_the_reservations(pair, tiny_loaded):
    reservation = pair.decode.reserve(_request("r"))  # max_new_tokens 6
    payload = _exported(tiny_loaded, "r", reservation.token)
    payload.state.max_output_tokens = 100  # the wire claims more than was reserved
    payload.state.num_cached_tokens = 10**6
    sender = create_sender(pair.transport, shared_memory=False)
    try:
        sender.send(pair.endpoint, payload, timeout=5.0)
    finally:
        sender.close()
    events = pair.reader.items(pair.decode, "r")
    assert len(events) == 5  # 6 outputs, the first made on the prefill side
    assert {e.num_cached_tokens for e in events} <= set(range(len(PROMPT) + 1))


# ---- one endless multipart message --------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _stream_endless_message(endpoint: str, num_mib: int) -> None:
    """Speak ZMTP 3.0 (NULL mechanism, as a DEALER) to ``endpoint`` and stream ``num_mib`` 1 MiB
    frames of one message, never its last (libzmq itself would send nothing of an unfinished
    message)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    with conn, contextlib.suppress(OSError):  # refused mid-way: what was sent is sent
        conn.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)
        greeting = b""
        while len(greeting) < 64:
            chunk = conn.recv(64 - len(greeting))
            if not chunk:
                return  # the receiver wants another mechanism: dropped us
            greeting += chunk
        name, value = b"Socket-Type", b"DEALER"
        ready = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
        conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
        frame = b"\x03" + struct.pack(">Q", 2**20) + b"x" * 2**20  # a long frame, MORE set
        for _ in range(num_mib):
            conn.sendall(frame)
        time.sleep(1.0)  # taken in by the receiver's I/O thread, wherever it goes


def _growth(receiver_credentials) -> float:
    from engine.transfer.transports import create_receiver

    receiver = create_receiver("zmq", lambda item: "refused", credentials=receiver_credentials)
    try:
        before = _rss_mib()
        _stream_endless_message(receiver.endpoint, 128)
        return _rss_mib() - before
    finally:
        receiver.close()


def test_an_endless_multipart_message_from_a_stranger_never_reaches_an_encrypted_receiver():
    """ZMQ hands a multipart message over only once it is complete, so no receiver can refuse
    one as it arrives (a plaintext receiver keeps all of it): the bound is who may connect. With
    CURVE (the default off loopback, where plain text is refused) a stranger never completes
    the handshake and nothing it streams is kept."""
    from engine.transfer.security import generate_credentials

    plaintext = _growth(None)
    # the finding: most of the 128 MiB is kept (pages this process freed earlier absorb some)
    assert plaintext > 64, f"a plaintext receiver grew {plaintext:.0f} MiB only"
    encrypted = _growth(generate_credentials().receiver)
    assert encrypted < 16, f"an encrypted receiver grew {encrypted:.0f} MiB"


def test_a_gated_plaintext_receiver_keeps_nothing_of_a_strangers_endless_message():
    """A plaintext plane of a cluster (loopback, or allowed off it) admits only the cluster's
    senders too (ZMQ PLAIN with a per-start password): a stranger gets no message in."""
    from engine.transfer.security import generate_credentials

    gated = _growth(generate_credentials().receiver.plaintext_gate())
    assert gated < 16, f"a gated plaintext receiver grew {gated:.0f} MiB"


@pytest.mark.parametrize("shared_memory", [False, True], ids=["frames", "shm"])
def test_only_the_clusters_senders_get_into_a_gated_plaintext_receiver(payload, shared_memory):
    from engine.transfer.base import KVTransferError
    from engine.transfer.security import generate_credentials
    from engine.transfer.transports import create_receiver
    from tests.support.transport_recorder import Recorder

    keys, other = generate_credentials(), generate_credentials()
    plain = KVTransferConfig("zmq", encryption="off")
    gate = transfer_credentials(plain, keys.receiver)
    assert gate is not None and not gate.encrypts  # plain text: a password, no keys
    recorder = Recorder(payload.layout)
    receiver = create_receiver("zmq", recorder, credentials=gate)
    strangers = [None, other.sender.plaintext_gate(), keys.sender]  # none, another's, CURVE
    try:
        for credentials in strangers:
            stranger = create_sender("zmq", shared_memory, credentials=credentials)
            with pytest.raises(KVTransferError):
                stranger.send(receiver.endpoint, payload, timeout=1.0)
            stranger.close()
        member = create_sender("zmq", shared_memory, transfer_credentials(plain, keys.sender))
        assert member.send(receiver.endpoint, payload, timeout=10) in ("frames", "shared_memory")
        member.close()
    finally:
        receiver.close()
    assert len(recorder.received) == 1
