"""What the KV plane bounds, over real sockets: a plaintext plane off loopback is refused at
start (allowed only explicitly, and then warned about); a header frame past the receiver's limit
is refused unparsed; pages travel in bounded frames, a larger frame is dropped by ZMQ and a
message with more frames than its header announced is refused and ends its reservation; the
decode worker's output limit and cached-token count are its reservation's, not the wire's."""

from __future__ import annotations

import json
import logging
import time

import pytest

from coordinator.cluster_config import ClusterConfig
from coordinator.config import load_config
from engine.config import KVTransferConfig
from engine.errors import ConfigError
from engine.request import RequestStatus
from engine.transfer import create_sender
from engine.transfer.base import PAGE_FRAME_BYTES, header_limit
from engine.transfer.codec import encode_header
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.security import transfer_credentials
from tests.test_kv_hostile import PROMPT, Pair, _exported, _raw_send, _refused, _request
from tests.worker_streams import collect

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
        ClusterConfig(kv_host="auto", kv_encryption="off")  # the node's IP
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
    data = payload.blocks.numpy().tobytes()
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
                frames.append(payload.blocks.numpy().tobytes())
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
    events = collect(pair.decode.stream("r"))
    assert len(events) == 5  # 6 outputs, the first made on the prefill side
    assert {e.num_cached_tokens for e in events} <= set(range(len(PROMPT) + 1))


# ---- one endless multipart message --------------------------------------------------------------

_ENDLESS = """
import sys, time, zmq
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.setsockopt(zmq.LINGER, 0)
socket.connect(sys.argv[1])
frame = b"x" * 2**20
for _ in range(int(sys.argv[2])):
    socket.send(frame, zmq.SNDMORE)  # never the last frame
print("sent", flush=True)
time.sleep(60)
"""


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _endless_message_growth(endpoint: str, num_mib: int) -> float:
    """How much this process grows while a stranger streams ``num_mib`` MiB of one multipart
    message (never finished) at ``endpoint``."""
    import subprocess
    import sys

    before = _rss_mib()
    attacker = subprocess.Popen(
        [sys.executable, "-c", _ENDLESS, endpoint, str(num_mib)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "sent"
        time.sleep(1.0)  # what was sent is in by now, wherever it could go
        return _rss_mib() - before
    finally:
        attacker.kill()
        attacker.wait()


def test_an_endless_multipart_message_from_a_stranger_never_reaches_an_encrypted_receiver():
    """ZMQ hands a multipart message over only once it is complete, so no receiver can refuse
    one as it arrives: the bound is who may connect. With CURVE (the default off loopback, and
    plain text off loopback is refused) a stranger never completes the handshake and nothing
    it streams is kept."""
    from engine.transfer import create_receiver
    from engine.transfer.security import generate_credentials

    keys = generate_credentials()
    receiver = create_receiver("zmq", lambda item: "refused", credentials=keys.receiver)
    try:
        growth = _endless_message_growth(receiver.endpoint, 128)
        assert growth < 32, f"the receiver grew {growth:.0f} MiB"
    finally:
        receiver.close()
