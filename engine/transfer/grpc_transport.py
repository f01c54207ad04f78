"""KV hand-off over gRPC: client streaming of the pages in 4 MiB chunks (``KVTransfer.Push``).

The first chunk carries the header; the receiver runs the handshake on it before reading further
or sizing anything and answers a refusal at once. Chunks are copied into a per-thread reused
buffer; more bytes or chunks than the header declared are refused, and a message larger than one
chunk plus a header is refused by gRPC itself. Both sides count
each installed payload under ``CHUNKS``.

The receiver serves at most ``MAX_CONCURRENT_PUSHES`` pushes at once; one more is refused at
once with RESOURCE_EXHAUSTED, and the sender tries again (with a short back-off) until its
deadline. A push may last at most ``stream_timeout_s`` on the receiver (the transfer timeout):
then it is cut, so idle or stalled clients cannot hold the receiver's threads. The sender's
deadline is its transfer timeout; a failed call closes its channel (``endpoints.py``).

Encrypted (with :class:`KVCredentials`): TLS on both sides with the cluster's CA; the receiver
requires a client certificate from it, the sender checks the receiver's certificate for
``KV_TLS_NAME``.

Fault injection (``break_next``): the receiver reads the first chunk, then ends the call with
UNAVAILABLE, as a connection lost mid-stream: the sender fails at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import torch

from engine.transfer.base import (
    CHUNKS,
    INJECTED_BREAK,
    PAGE_FRAME_BYTES,
    BaseKVReceiver,
    BaseKVSender,
    BrokenHandler,
    KVRefusedError,
    KVTransferError,
    PayloadHandler,
    ReceiverLimits,
)
from engine.transfer.codec import (
    byte_view,
    decode_payload,
    encode_header,
    page_bytes,
)
from engine.transfer.endpoints import EndpointCache
from engine.transfer.payload import KVPayload
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.proto import kv_transfer_pb2_grpc as pb_grpc
from engine.transfer.security import KV_TLS_NAME, KVCredentials

log = logging.getLogger(__name__)
CHUNK_BYTES = PAGE_FRAME_BYTES
MAX_CONCURRENT_PUSHES = 4
_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]
_RETRY_FIRST_S, _RETRY_MAX_S = 0.02, 0.1


class _StreamWatchdog:
    """Cuts pushes that last longer than ``timeout_s``, from a thread of its own: calls the
    push's ``on_cut``, then cancels its call. (A handler blocked on the next message is not
    always woken by the cancel, so ``on_cut`` is what reports the transfer broken.)"""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._active: dict[int, tuple[float, grpc.ServicerContext, Callable[[], None]]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-grpc-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, context: grpc.ServicerContext, on_cut: Callable[[], None]) -> Iterator[None]:
        key = next(self._keys)
        with self._lock:
            self._active[key] = (time.monotonic() + self._timeout_s, context, on_cut)
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(key, None)

    def _run(self) -> None:
        period = min(0.1, self._timeout_s / 4)
        while not self._stopped.wait(period):
            now = time.monotonic()
            with self._lock:
                late = [key for key, (deadline, _, _) in self._active.items() if deadline < now]
                cut = [self._active.pop(key)[1:] for key in late]
            for context, on_cut in cut:
                on_cut()
                context.cancel()  # the handler's next read raises (mostly); its thread is freed

    def stop(self) -> None:
        self._stopped.set()


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, receiver: GrpcKVReceiver) -> None:
        self._receiver = receiver
        self._local = threading.local()

    def _buffer(self, num_bytes: int) -> torch.Tensor:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < num_bytes:
            buffer = self._local.buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return buffer

    def Push(
        self, request_iterator: Iterator[pb.KVChunkMsg], context: grpc.ServicerContext
    ) -> pb.KVAckMsg:
        push = _PushState()
        with self._receiver.watchdog.watch(context, lambda: push.report_cut(self._receiver)):
            try:
                first = next(request_iterator, None)
                if first is None:
                    return pb.KVAckMsg(ok=False, error="malformed transfer: no header")
                push.request_id = first.header.state.request_id
                if not self._receiver.breaker.take():
                    return self._push(push, first, request_iterator, context)
            except grpc.RpcError:  # cut by the watchdog, or the client went away
                push.report_cut(self._receiver)
                return pb.KVAckMsg(request_id=push.request_id, ok=False, error="stream cut")
            except Exception as exc:  # anything malformed: refused, the server goes on
                log.warning("malformed KV transfer refused: %r", exc)
                error = f"malformed transfer: {type(exc).__name__}"
                return pb.KVAckMsg(request_id=push.request_id, ok=False, error=error)
        self._receiver.report_broken(push.request_id, INJECTED_BREAK)
        context.abort(grpc.StatusCode.UNAVAILABLE, INJECTED_BREAK)  # raises
        raise AssertionError("unreachable")

    def _push(
        self,
        push: _PushState,
        first: pb.KVChunkMsg,
        rest: Iterator[pb.KVChunkMsg],
        context: grpc.ServicerContext,
    ) -> pb.KVAckMsg:
        header = first.header
        request_id = push.request_id
        if header.ByteSize() > self._receiver.max_header_bytes:
            limit = self._receiver.max_header_bytes
            too_large = f"malformed transfer: header exceeds {limit} bytes"
            return pb.KVAckMsg(request_id=request_id, ok=False, error=too_large)
        error = self._receiver.handshake(header)  # before any buffer is sized by the header
        if error is not None:
            return pb.KVAckMsg(request_id=request_id, ok=False, error=error)
        push.accepted = True
        buffer = self._buffer(header.num_bytes)
        view = byte_view(buffer)
        offset = 0
        max_chunks = max(math.ceil(header.num_bytes / CHUNK_BYTES), 1)
        for count, chunk in enumerate(itertools.chain([first], rest), start=1):
            end = offset + len(chunk.data)
            if end > header.num_bytes or count > max_chunks:
                push.report_cut(self._receiver)  # the reservation ends: no pages for it
                return pb.KVAckMsg(
                    request_id=request_id, ok=False, error="more bytes or chunks than declared"
                )
            view[offset:end] = chunk.data
            offset = end
        if offset != header.num_bytes:
            error = f"expected {header.num_bytes} bytes, got {offset}"
            if not context.is_active():  # the call ended early: its iterator may just stop
                push.report_cut(self._receiver)
            return pb.KVAckMsg(request_id=request_id, ok=False, error=error)
        error = self._receiver.accept(decode_payload(header, buffer), CHUNKS)
        return pb.KVAckMsg(request_id=request_id, ok=error is None, error=error or "")


@dataclass
class _PushState:
    request_id: str = ""
    accepted: bool = False  # the handshake accepted its header
    cut: bool = False  # reported cut already

    def report_cut(self, receiver: GrpcKVReceiver) -> None:
        """Once per push: a cut stream ends its reservation, if the handshake accepted it (only
        a sender the reservation accepted may end it)."""
        already, self.cut = self.cut, True
        if self.accepted and not already:
            receiver.report_broken(self.request_id, "the stream was cut")


class GrpcKVReceiver(BaseKVReceiver):
    def __init__(
        self,
        handler: PayloadHandler,
        host: str = "127.0.0.1",
        on_broken: BrokenHandler | None = None,
        limits: ReceiverLimits | None = None,
        credentials: KVCredentials | None = None,
    ) -> None:
        super().__init__(handler, on_broken, limits)
        self.watchdog = _StreamWatchdog(self.limits.stream_timeout_s)
        # One chunk at most: a larger message is refused by gRPC before it reaches us.
        max_message = min(CHUNK_BYTES, self.max_payload_bytes) + self.max_header_bytes
        self._server = grpc.server(
            futures.ThreadPoolExecutor(MAX_CONCURRENT_PUSHES, thread_name_prefix="kv-grpc"),
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", 2**20),  # an acknowledgement
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_PUSHES,
        )
        pb_grpc.add_KVTransferServicer_to_server(_Servicer(self), self._server)
        address = f"{host}:0"
        if credentials is None or not credentials.encrypts:  # plain text: nothing to admit by
            port = self._server.add_insecure_port(address)
        else:
            tls = grpc.ssl_server_credentials(
                [(credentials.tls_key, credentials.tls_certificate)],
                root_certificates=credentials.tls_ca,
                require_client_auth=True,
            )
            port = self._server.add_secure_port(address, tls)
        self.endpoint = f"{host}:{port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=1)
        self.watchdog.stop()


class GrpcKVSender(BaseKVSender):
    def __init__(self, credentials: KVCredentials | None = None) -> None:
        super().__init__()
        self._credentials = credentials
        self._channels: EndpointCache[grpc.Channel] = EndpointCache(
            self._open, lambda channel: channel.close()
        )

    def _open(self, endpoint: str) -> grpc.Channel:
        if self._credentials is None or not self._credentials.encrypts:
            return grpc.insecure_channel(endpoint, options=_OPTIONS)
        tls = grpc.ssl_channel_credentials(
            root_certificates=self._credentials.tls_ca,
            private_key=self._credentials.tls_key,
            certificate_chain=self._credentials.tls_certificate,
        )
        options = [*_OPTIONS, ("grpc.ssl_target_name_override", KV_TLS_NAME)]
        return grpc.secure_channel(endpoint, tls, options=options)

    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._channels.lease(endpoint) as link:
            try:
                ack = _push(pb_grpc.KVTransferStub(link.conn), payload, deadline)
            except grpc.RpcError as exc:
                self._channels.discard(endpoint, link)
                raise KVTransferError(f"gRPC {exc.code().name}: {exc.details()}") from exc
        if not ack.ok:
            raise KVRefusedError(ack.error)
        self.payloads_by_path.add(CHUNKS)
        return CHUNKS

    def close(self) -> None:
        self._channels.close()


def _push(stub: pb_grpc.KVTransferStub, payload: KVPayload, deadline: float) -> pb.KVAckMsg:
    """One ``Push`` call, tried again while the receiver is busy (RESOURCE_EXHAUSTED) and the
    deadline allows."""
    pause = _RETRY_FIRST_S
    while True:
        left = deadline - time.monotonic()
        try:
            return stub.Push(chunk_messages(payload), timeout=max(left, 0.001))
        except grpc.RpcError as exc:
            busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not busy or deadline - time.monotonic() <= pause:
                raise
        time.sleep(pause)
        pause = min(2 * pause, _RETRY_MAX_S)


def chunk_messages(payload: KVPayload) -> Iterator[pb.KVChunkMsg]:
    """The header with the first ``CHUNK_BYTES`` of pages, then the next ``CHUNK_BYTES`` each."""
    data = page_bytes(payload)
    yield pb.KVChunkMsg(header=encode_header(payload), data=bytes(data[:CHUNK_BYTES]))
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield pb.KVChunkMsg(data=bytes(data[start : start + CHUNK_BYTES]))
