"""KV hand-off over gRPC: client streaming of the pages in 4 MiB chunks (``KVTransfer.Push``).

The first chunk carries the header; the receiver checks its layout before reading further and
answers a mismatch at once. Chunks are copied into a per-thread reused buffer. Both sides count
each installed payload under ``CHUNKS``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from engine.transfer.base import (
    CHUNKS,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferError,
    PathCounts,
    PayloadHandler,
)
from engine.transfer.codec import (
    byte_view,
    decode_layout,
    decode_payload,
    encode_header,
    page_bytes,
)
from engine.transfer.payload import KVPayload
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.proto import kv_transfer_pb2_grpc as pb_grpc

CHUNK_BYTES = 4 * 2**20
_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]


class _Servicer(pb_grpc.KVTransferServicer):
    def __init__(self, handler: PayloadHandler, counts: PathCounts) -> None:
        self._handler = handler
        self._counts = counts
        self._local = threading.local()

    def _buffer(self, num_bytes: int) -> torch.Tensor:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < num_bytes:
            buffer = self._local.buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return buffer

    def Push(
        self, request_iterator: Iterator[pb.KVChunkMsg], context: grpc.ServicerContext
    ) -> pb.KVAckMsg:
        first = next(request_iterator)
        header = first.header
        request_id = header.state.request_id
        error = self._handler(decode_layout(header))
        if error is not None:
            return pb.KVAckMsg(request_id=request_id, ok=False, error=error)
        buffer = self._buffer(header.num_bytes)
        view = byte_view(buffer)
        offset = 0
        for chunk in _chain(first, request_iterator):
            end = offset + len(chunk.data)
            if end > header.num_bytes:
                return pb.KVAckMsg(
                    request_id=request_id, ok=False, error="more bytes than declared"
                )
            view[offset:end] = chunk.data
            offset = end
        if offset != header.num_bytes:
            return pb.KVAckMsg(
                request_id=request_id,
                ok=False,
                error=f"expected {header.num_bytes} bytes, got {offset}",
            )
        error = self._handler(decode_payload(header, buffer))
        if error is None:
            self._counts.add(CHUNKS)
        return pb.KVAckMsg(request_id=request_id, ok=error is None, error=error or "")


def _chain(first: pb.KVChunkMsg, rest: Iterator[pb.KVChunkMsg]) -> Iterator[pb.KVChunkMsg]:
    yield first
    yield from rest


class GrpcKVReceiver(BaseKVReceiver):
    def __init__(self, handler: PayloadHandler, host: str = "127.0.0.1") -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_OPTIONS)
        servicer = _Servicer(handler, self.payloads_by_path)
        pb_grpc.add_KVTransferServicer_to_server(servicer, self._server)
        port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"{host}:{port}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=1)


class GrpcKVSender(BaseKVSender):
    def __init__(self) -> None:
        super().__init__()
        self._channels: dict[str, grpc.Channel] = {}
        self._guard = threading.Lock()

    def _stub(self, endpoint: str) -> pb_grpc.KVTransferStub:
        with self._guard:
            if endpoint not in self._channels:
                self._channels[endpoint] = grpc.insecure_channel(endpoint, options=_OPTIONS)
            return pb_grpc.KVTransferStub(self._channels[endpoint])

    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> None:
        try:
            ack = self._stub(endpoint).Push(chunk_messages(payload), timeout=timeout)
        except grpc.RpcError as exc:
            raise KVTransferError(f"gRPC {exc.code().name}: {exc.details()}") from exc
        if not ack.ok:
            raise KVTransferError(ack.error)
        self.payloads_by_path.add(CHUNKS)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def chunk_messages(payload: KVPayload) -> Iterator[pb.KVChunkMsg]:
    """The header with the first ``CHUNK_BYTES`` of pages, then the next ``CHUNK_BYTES`` each."""
    data = page_bytes(payload)
    yield pb.KVChunkMsg(header=encode_header(payload), data=bytes(data[:CHUNK_BYTES]))
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield pb.KVChunkMsg(data=bytes(data[start : start + CHUNK_BYTES]))
