"""A receiver that records what the KV planes deliver: what the transport tests share."""

from __future__ import annotations

import torch

from engine.transfer.base import BaseKVSender
from engine.transfer.payload import KVLayout, KVPayload, TransferHeader
from engine.transfer.transports import create_receiver, create_sender

# a hand-off's settings (transport, shared_memory), and the path its pages must take
HANDOFFS = {
    "zmq_shm": (("zmq", True), "shared_memory"),
    "zmq_frames": (("zmq", False), "frames"),
    "grpc": (("grpc", True), "chunks"),
    "inprocess": (("inprocess", True), "direct"),
}


SOCKETS = ["zmq_shm", "zmq_frames", "grpc"]


def _pair(handoff: str, handler):
    (name, shared_memory), _ = HANDOFFS[handoff]
    return create_receiver(name, handler), create_sender(name, shared_memory)


def _assert_path(handoff: str, sender, receiver, count: int) -> None:
    """Both sides installed ``count`` payloads, all by ``handoff``'s path."""
    expected = {HANDOFFS[handoff][1]: count} if count else {}
    assert sender.payloads_by_path.as_dict() == expected
    assert receiver.payloads_by_path.as_dict() == expected


class Recorder:
    def __init__(self, expected: KVLayout) -> None:
        self.expected = expected
        self.received: list[KVPayload] = []

    def __call__(self, item):
        if isinstance(item, TransferHeader):
            try:
                self.expected.check_compatible(item.layout)
            except Exception as exc:
                return str(exc)
            return None
        self.received.append(KVPayload(item.layout, item.state, item.blocks.clone()))
        return None


def _pages(payload: KVPayload, num_blocks: int) -> KVPayload:
    """``payload`` with random pages of ``num_blocks`` blocks of 128 KiB (64 Ki float32)."""
    return KVPayload(payload.layout, payload.state, torch.randn(2, 2, num_blocks, 64, 4, 32))


def num_connections(sender: BaseKVSender) -> int:
    """Endpoints ``sender`` holds a socket (zmq) or a channel (grpc) for."""
    for name in ("_connections", "_channels"):
        if hasattr(sender, name):
            return len(getattr(sender, name))
    return 0
