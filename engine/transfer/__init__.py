"""KV hand-off transports behind one small interface, chosen by name.

``zmq`` (default): one multipart message per request (header frame + page frames sent zero-copy
from the exported buffer), received into reused buffers. ``grpc``: client streaming of 4 MiB
chunks. ``inprocess``: a direct call, for unit tests of engines in one process.
"""

from __future__ import annotations

from engine.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    KVTransferError,
    PayloadHandler,
)

TRANSPORTS = ("zmq", "grpc", "inprocess")


def create_receiver(name: str, handler: PayloadHandler, host: str = "127.0.0.1") -> BaseKVReceiver:
    """Start a receiver that calls ``handler`` for every payload and answers with its result."""
    if name == "zmq":
        from engine.transfer.zmq_transport import ZmqKVReceiver

        return ZmqKVReceiver(handler, host)
    if name == "grpc":
        from engine.transfer.grpc_transport import GrpcKVReceiver

        return GrpcKVReceiver(handler, host)
    if name == "inprocess":
        from engine.transfer.inprocess import InProcessKVReceiver

        return InProcessKVReceiver(handler)
    raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")


def create_sender(name: str) -> BaseKVSender:
    if name == "zmq":
        from engine.transfer.zmq_transport import ZmqKVSender

        return ZmqKVSender()
    if name == "grpc":
        from engine.transfer.grpc_transport import GrpcKVSender

        return GrpcKVSender()
    if name == "inprocess":
        from engine.transfer.inprocess import InProcessKVSender

        return InProcessKVSender()
    raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")


__all__ = [
    "TRANSPORTS",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVTransferError",
    "PayloadHandler",
    "create_receiver",
    "create_sender",
]
