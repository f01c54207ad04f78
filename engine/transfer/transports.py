"""A KV hand-off transport's sender or receiver, by its name (the package's docstring: what each
is)."""

from __future__ import annotations

from engine.config import TRANSPORTS
from engine.transfer.base import (
    BaseKVReceiver,
    BaseKVSender,
    BrokenHandler,
    PayloadHandler,
    ReceiverLimits,
)
from engine.transfer.security import KVCredentials


def create_receiver(
    name: str,
    handler: PayloadHandler,
    host: str = "127.0.0.1",
    *,
    on_broken: BrokenHandler | None = None,
    limits: ReceiverLimits | None = None,
    credentials: KVCredentials | None = None,
) -> BaseKVReceiver:
    """Start a receiver that calls ``handler`` for every header (the handshake) and payload and
    answers with its result, and ``on_broken`` (request id, why) for a transfer that broke after
    its header; within ``limits`` (larger frames are refused by the transport itself).
    ``credentials`` (the receivers' share): encrypted, admitting only the cluster's senders."""
    if name == "zmq":
        from engine.transfer.zmq_transport import ZmqKVReceiver

        return ZmqKVReceiver(handler, host, on_broken, limits, credentials)
    if name == "grpc":
        from engine.transfer.grpc_transport import GrpcKVReceiver

        return GrpcKVReceiver(handler, host, on_broken, limits, credentials)
    if name == "inprocess":
        from engine.transfer.inprocess import InProcessKVReceiver

        return InProcessKVReceiver(handler, on_broken)
    raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")


def create_sender(
    name: str, shared_memory: bool = True, credentials: KVCredentials | None = None
) -> BaseKVSender:
    """A sender for transport ``name``. ``shared_memory=False`` keeps ``zmq`` from its same-host
    ``/dev/shm`` path (the pages then always cross the socket); other transports have none.
    ``credentials`` (the senders' share): encrypted, talking only to the cluster's receivers."""
    if name == "zmq":
        from engine.transfer.zmq_transport import ZmqKVSender

        return ZmqKVSender(shared_memory, credentials)
    if name == "grpc":
        from engine.transfer.grpc_transport import GrpcKVSender

        return GrpcKVSender(credentials)
    if name == "inprocess":
        from engine.transfer.inprocess import InProcessKVSender

        return InProcessKVSender()
    raise ValueError(f"kv_transport must be one of {', '.join(TRANSPORTS)}; got {name!r}")
