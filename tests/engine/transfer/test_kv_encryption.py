"""The encrypted KV plane over real sockets: ZMQ CURVE and gRPC TLS carry the pages bit-exact;
a relay in the middle sees no page byte in the clear (it does without encryption); a sender
without the cluster's credentials, or of another cluster, gets nothing in; a sender never
talks to a receiver that is not the cluster's; and encryption is on by default off loopback."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from decode_worker.worker import DecodeWorker
from engine.config import KVTransferConfig, needs_encryption
from engine.errors import ConfigError
from engine.transfer.base import KVTransferError
from engine.transfer.payload import KVPayload
from engine.transfer.security import ClusterCredentials, generate_credentials
from engine.transfer.transports import create_receiver, create_sender
from prefill_worker.worker import PrefillWorker
from tests.support.transport_recorder import Recorder

# transport, shared_memory: the socket paths (same-host shared memory has no bytes on a wire)
SOCKET_TRANSPORTS = {"zmq_frames": ("zmq", False), "grpc": ("grpc", True)}
MARKER = b"pdserve-kv-plaintext-marker"


@pytest.fixture(scope="module")
def keys() -> ClusterCredentials:
    return generate_credentials()


@pytest.fixture(scope="module")
def other_keys() -> ClusterCredentials:
    return generate_credentials()


def _marked(payload: KVPayload) -> KVPayload:
    """``payload`` with pages full of a recognisable byte string."""
    raw = (MARKER * (payload.num_bytes // len(MARKER) + 1))[: payload.num_bytes]
    pages = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(payload.blocks.dtype)
    return KVPayload(payload.layout, payload.state, pages.view(payload.blocks.shape).clone())


class Relay:
    """A TCP relay in front of ``target`` ("host:port") recording the bytes that go through."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def close(self) -> None:
        self._listener.close()


def _endpoint(transport: str, receiver) -> str:
    return receiver.endpoint.removeprefix("tcp://") if transport == "zmq" else receiver.endpoint


def _through(transport: str, relay: Relay) -> str:
    address = f"127.0.0.1:{relay.port}"
    return f"tcp://{address}" if transport == "zmq" else address


@pytest.mark.parametrize("handoff", SOCKET_TRANSPORTS)
@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "plain"])
def test_pages_cross_the_wire_encrypted(handoff, encrypted, payload, keys):
    transport, shared_memory = SOCKET_TRANSPORTS[handoff]
    marked = _marked(payload)
    recorder = Recorder(payload.layout)
    receiver = create_receiver(
        transport, recorder, credentials=keys.receiver if encrypted else None
    )
    sender = create_sender(transport, shared_memory, credentials=keys.sender if encrypted else None)
    relay = Relay(_endpoint(transport, receiver))
    try:
        for _ in range(2):
            sender.send(_through(transport, relay), marked, timeout=10)
    finally:
        sender.close()
        receiver.close()
        relay.close()
    assert len(recorder.received) == 2
    assert all(torch.equal(got.blocks, marked.blocks) for got in recorder.received)
    assert len(relay.seen) > marked.num_bytes  # every page went through the relay
    assert (MARKER in relay.seen) is not encrypted


def _refused(transport: str, receiver_keys, sender_keys, payload, shared_memory=False) -> str:
    recorder = Recorder(payload.layout)
    receiver = create_receiver(transport, recorder, credentials=receiver_keys)
    sender = create_sender(transport, shared_memory, credentials=sender_keys)
    try:
        with pytest.raises(KVTransferError) as refusal:
            sender.send(receiver.endpoint, payload, timeout=1.5)
    finally:
        sender.close()
        receiver.close()
    assert recorder.received == []
    return str(refusal.value)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_a_sender_without_the_clusters_credentials_gets_nothing_in(
    transport,
    payload,
    keys,
    other_keys,
):
    for sender_keys in (None, other_keys.sender, keys.receiver):  # plain, another cluster's, ...
        _refused(transport, keys.receiver, sender_keys, payload)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_a_sender_never_talks_to_a_receiver_that_is_not_the_clusters(
    transport,
    payload,
    keys,
    other_keys,
):
    """An impostor receiver (plain, or with another cluster's keys) gets no page, not even
    through the same-host shared-memory path."""
    for receiver_keys in (None, other_keys.receiver):
        _refused(transport, receiver_keys, keys.sender, payload, shared_memory=True)


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_the_receiver_serves_its_cluster_after_refusing_strangers(
    transport,
    payload,
    keys,
    other_keys,
):
    recorder = Recorder(payload.layout)
    receiver = create_receiver(transport, recorder, credentials=keys.receiver)
    stranger = create_sender(transport, False, credentials=other_keys.sender)
    member = create_sender(transport, False, credentials=keys.sender)
    try:
        with pytest.raises(KVTransferError):
            stranger.send(receiver.endpoint, payload, timeout=1.0)
        member.send(receiver.endpoint, payload, timeout=10)
    finally:
        for side in (stranger, member, receiver):
            side.close()
    assert len(recorder.received) == 1


@pytest.mark.parametrize(
    "mode, host, expected",
    [
        ("auto", "127.0.0.1", False),
        ("auto", "localhost", False),
        ("auto", "::1", False),
        ("auto", "auto", True),  # the node's IP, reachable from other hosts
        ("auto", "10.0.0.7", True),
        ("auto", "0.0.0.0", True),
        ("on", "127.0.0.1", True),
        ("off", "10.0.0.7", False),
    ],
)
def test_encryption_is_on_by_default_off_loopback(mode, host, expected):
    assert needs_encryption(mode, host) is expected
    allow = mode == "off"  # plain text off loopback must be allowed explicitly
    config = KVTransferConfig("zmq", host, encryption=mode, allow_plaintext_off_loopback=allow)
    assert config.encrypted is expected
    assert not KVTransferConfig("inprocess", host, encryption=mode).encrypted


def test_an_encrypted_worker_without_credentials_refuses_to_start(tiny_model_dir):
    from tests.support.inprocess_workers import _config

    transfer = KVTransferConfig("zmq", encryption="on")
    for worker in (PrefillWorker, DecodeWorker):
        with pytest.raises(ConfigError, match="encrypted .* but this worker got no credentials"):
            worker(_config(tiny_model_dir), transfer)


def test_bad_encryption_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_encryption must be one of auto, on, off"):
        KVTransferConfig("zmq", encryption="yes")


def test_credentials_never_show_in_a_repr(keys):
    text = repr(keys)
    assert keys.sender.curve_secret.decode() not in text
    assert b"PRIVATE KEY" in keys.sender.tls_key and "PRIVATE" not in text
