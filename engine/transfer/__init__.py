"""KV hand-off transports behind one small interface, chosen by name.

``zmq`` (default): on one host the pages go through a ``/dev/shm`` file of the sender's and the
socket carries only the header (``shared_memory.py``); otherwise, or with ``shared_memory=False``,
one multipart message per request: a header frame and one page frame sent zero-copy from the
exported buffer, received into a reused buffer. ``grpc``: client streaming of 4 MiB chunks.
``inprocess``: a direct call, for unit tests of engines in one process.

With :class:`KVCredentials` (``security.py``) ZMQ runs CURVE and gRPC runs TLS, both with peer
authentication: a receiver admits only the cluster's senders, a sender talks only to the
cluster's receivers.

A receiver serves its transfers within ``stream_timeout_s`` each (gRPC cuts longer pushes; a ZMQ
message is whole or absent) and tells ``on_broken`` about transfers that broke after their
header. A sender keeps one connection per endpoint in use, closed when a transfer over it breaks
or when it stays unused (``endpoints.py``).

Senders and receivers count the payloads installed by the path their pages took
(``payloads_by_path``: ``shared_memory``, ``frames``, ``chunks`` or ``direct``).
"""

from __future__ import annotations

from engine.config import TRANSPORTS
from engine.transfer.base import (
    CHUNKS,
    FRAMES,
    PATHS,
    SHARED_MEMORY,
    BaseKVReceiver,
    BaseKVSender,
    BrokenHandler,
    KVTransferError,
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


__all__ = [
    "CHUNKS",
    "FRAMES",
    "PATHS",
    "SHARED_MEMORY",
    "BaseKVReceiver",
    "BaseKVSender",
    "KVCredentials",
    "KVTransferError",
    "ReceiverLimits",
    "create_receiver",
    "create_sender",
]
