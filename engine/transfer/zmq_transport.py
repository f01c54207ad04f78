"""KV hand-off over ZeroMQ.

Receiver: a ROUTER socket on a random port, served by one thread. Each transfer is one multipart
message ``[header, pages]``; the pages are received straight into a reused buffer
(``recv_into``), checked against the header's layout first, handed to the handler, and answered
with a ``KVAckMsg``. Sender: one DEALER socket per endpoint, pages sent zero-copy from the
exported buffer; the answer is awaited with a timeout, after which the socket is discarded so a
late answer can never be taken for the next transfer's.

Same host: unless built with ``shared_memory=False``, the sender first tries a shared-memory
hand-off (``shared_memory.py``): the pages go into its ``/dev/shm`` file and the message carries
only the header. A receiver that cannot map the file (another host, another IPC namespace) says
so, and that endpoint gets frames from then on. Both sides count each installed payload under
``SHARED_MEMORY`` or ``FRAMES``.
"""

from __future__ import annotations

import logging
import threading

import torch
import zmq

from engine.transfer.base import (
    FRAMES,
    SHARED_MEMORY,
    BaseKVReceiver,
    BaseKVSender,
    KVTransferError,
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
from engine.transfer.shared_memory import SharedPageBuffer, SharedPageReader

log = logging.getLogger(__name__)
_POLL_MS = 100
SHM_UNAVAILABLE = "shared memory unavailable"


class ZmqKVReceiver(BaseKVReceiver):
    def __init__(self, handler: PayloadHandler, host: str = "127.0.0.1") -> None:
        super().__init__()
        self._handler = handler
        self._socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port: int = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._shared = SharedPageReader()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-zmq-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(_POLL_MS, zmq.POLLIN):
                identity = self._socket.recv()
                ack = self._receive_one()
                self._socket.send_multipart([identity, ack.SerializeToString()])
        self._socket.close(0)

    def _receive_one(self) -> pb.KVAckMsg:
        header = pb.KVHeaderMsg()
        header.ParseFromString(self._socket.recv())
        request_id = header.state.request_id
        if header.shm_path:
            return self._receive_shared(header)
        if header.num_bytes > self._buffer.numel():
            self._buffer = torch.empty(header.num_bytes, dtype=torch.uint8)
        view = byte_view(self._buffer)
        received = self._socket.recv_into(view) if self._socket.getsockopt(zmq.RCVMORE) else 0
        while self._socket.getsockopt(zmq.RCVMORE):  # drain anything unexpected
            self._socket.recv()
        if received != header.num_bytes:
            return pb.KVAckMsg(
                request_id=request_id,
                ok=False,
                error=f"expected {header.num_bytes} bytes, got {received}",
            )
        return self._deliver(header, self._buffer, FRAMES)

    def _receive_shared(self, header: pb.KVHeaderMsg) -> pb.KVAckMsg:
        while self._socket.getsockopt(zmq.RCVMORE):
            self._socket.recv()
        try:
            pages = self._shared.view(header.shm_path, header.num_bytes)
        except (OSError, ValueError) as exc:
            return pb.KVAckMsg(
                request_id=header.state.request_id, ok=False, error=f"{SHM_UNAVAILABLE}: {exc}"
            )
        return self._deliver(header, pages, SHARED_MEMORY)

    def _deliver(self, header: pb.KVHeaderMsg, data: torch.Tensor, path: str) -> pb.KVAckMsg:
        error = self._handler(decode_layout(header)) or self._handler(decode_payload(header, data))
        if error is None:
            self.payloads_by_path.add(path)
        return pb.KVAckMsg(request_id=header.state.request_id, ok=error is None, error=error or "")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class ZmqKVSender(BaseKVSender):
    def __init__(self, shared_memory: bool = True) -> None:
        """``shared_memory=False``: the pages always go as frames, as between hosts."""
        super().__init__()
        self._use_shared_memory = shared_memory
        self._context: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._shared: dict[str, SharedPageBuffer | None] = {}  # None: endpoint takes frames
        self._guard = threading.Lock()

    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> None:
        with self._guard:
            lock = self._locks.setdefault(endpoint, threading.Lock())
        with lock:
            header = encode_header(payload)
            for _ in range(2):  # a receiver that dropped its mapping gets a fresh file once
                shared = self._shared_buffer(endpoint, payload.num_bytes)
                if shared is None:
                    break
                shared.write(payload.blocks)
                header.shm_path = str(shared.path)
                ack = self._exchange(endpoint, [header.SerializeToString()], timeout)
                if ack.ok or not ack.error.startswith(SHM_UNAVAILABLE):
                    shared.is_mapped_by_receiver = True
                    return self._check(ack, SHARED_MEMORY)
                shared.close()
                self._shared[endpoint] = None
                if not shared.is_mapped_by_receiver:
                    break  # never could map it: another host; frames from now on
                del self._shared[endpoint]
            header.shm_path = ""
            frames = [header.SerializeToString(), page_bytes(payload)]
            self._check(self._exchange(endpoint, frames, timeout), FRAMES)

    def _shared_buffer(self, endpoint: str, num_bytes: int) -> SharedPageBuffer | None:
        if not self._use_shared_memory or (
            endpoint in self._shared and self._shared[endpoint] is None
        ):
            return None
        current = self._shared.get(endpoint)
        if current is not None and current.num_bytes >= num_bytes:
            return current
        try:
            fresh = SharedPageBuffer(num_bytes)
        except OSError as exc:
            log.info("no shared-memory hand-off to %s: %s", endpoint, exc)
            self._shared[endpoint] = None
            return None
        if current is not None:
            current.close()
        self._shared[endpoint] = fresh
        return fresh

    def _check(self, ack: pb.KVAckMsg, path: str) -> None:
        if not ack.ok:
            raise KVTransferError(ack.error)
        self.payloads_by_path.add(path)

    def _exchange(self, endpoint: str, frames: list, timeout: float) -> pb.KVAckMsg:
        socket = self._socket(endpoint)
        socket.send_multipart(frames, copy=False)
        if not socket.poll(int(timeout * 1000), zmq.POLLIN):
            self._drop(endpoint)
            raise KVTransferError(f"no answer from {endpoint} within {timeout:.1f} s")
        ack = pb.KVAckMsg()
        ack.ParseFromString(socket.recv())
        return ack

    def _socket(self, endpoint: str) -> zmq.Socket:
        if endpoint not in self._sockets:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            self._sockets[endpoint] = socket
        return self._sockets[endpoint]

    def _drop(self, endpoint: str) -> None:
        socket = self._sockets.pop(endpoint, None)
        if socket is not None:
            socket.close(0)

    def close(self) -> None:
        for endpoint in list(self._sockets):
            self._drop(endpoint)
        for shared in self._shared.values():
            if shared is not None:
                shared.close()
        self._shared.clear()
