"""KV hand-off over ZeroMQ.

Receiver: a ROUTER socket on a random port, served by one thread. Each transfer is one multipart
message ``[header, page frame, ...]``: the header (refused unparsed past the receiver's
``max_header_bytes``), then the pages in frames of ``PAGE_FRAME_BYTES`` (the last one shorter),
received straight into a reused buffer (``recv_into``) once the handshake accepted the header
(nothing is sized by a header before), handed to the handler, and answered with a ``KVAckMsg``.
A malformed message is answered with a refusal; the thread goes on serving; a message with more
frames or bytes than its header announced is refused and ends the reservation. A frame larger
than a page frame or a header (``MAXMSGSIZE``) never arrives: ZMQ drops its sender's connection.
ZMQ hands a multipart message over only once all of it arrived, so the size of a whole message
is bounded only by who may connect: CURVE admits the cluster's senders alone, and a plaintext
plane is refused off loopback (``KVTransferConfig``).

Sender: one DEALER socket per endpoint (``endpoints.py``), one transfer at a time on it, pages
sent zero-copy from the exported buffer. The answer is awaited at most the transfer's timeout;
then, or on any socket error, the socket is closed and forgotten, so a late answer can never be
taken for the next transfer's, and an endpoint that is gone leaves nothing open.

Same host: unless built with ``shared_memory=False``, the sender first tries a shared-memory
hand-off (``shared_memory.py``): the pages go into its ``/dev/shm`` file and the message carries
only the header, with the file's name (never a path). A receiver that cannot map the file
(another host, another IPC namespace) says so, and that endpoint gets frames from then on. Both
sides count each installed payload under ``SHARED_MEMORY`` or ``FRAMES``.

Plain text with a gate (credentials holding only a password): ZMQ PLAIN, the receiver's ZAP
handler admitting only the cluster's password, so a stranger gets no message in.

Encrypted (with :class:`KVCredentials`): CURVE on both sides. The receiver's socket lives in a
context of its own whose ZAP handler admits only the senders' public key; a sender that is not
the cluster's, or a receiver that is not (a wrong server key), never completes the handshake, so
no message is exchanged and the sender fails when its timeout runs out.

Fault injection (``break_next``): the receiver reads the header, drops the rest and never
answers, which is what a connection lost mid-transfer looks like to a ZMQ sender (ZMQ reconnects
silently; the message is simply gone): the sender fails when its timeout runs out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine.transfer.base import (
    FRAMES,
    INJECTED_BREAK,
    PAGE_FRAME_BYTES,
    SHARED_MEMORY,
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
from engine.transfer.endpoints import EndpointCache, Link
from engine.transfer.payload import KVPayload
from engine.transfer.proto import kv_transfer_pb2 as pb
from engine.transfer.security import KVCredentials
from engine.transfer.shared_memory import SharedPageBuffer, SharedPageReader
from engine.transfer.zmq_security import admit_only, secure_client, secure_server

log = logging.getLogger(__name__)
_POLL_MS = 100
SHM_UNAVAILABLE = "shared memory unavailable"


# bytes a CURVE MESSAGE adds to a frame (command name, nonce, MAC), with room to spare
CURVE_FRAMING = 256


class ZmqKVReceiver(BaseKVReceiver):
    def __init__(
        self,
        handler: PayloadHandler,
        host: str = "127.0.0.1",
        on_broken: BrokenHandler | None = None,
        limits: ReceiverLimits | None = None,
        credentials: KVCredentials | None = None,
    ) -> None:
        super().__init__(handler, on_broken, limits)
        self._context: zmq.Context = zmq.Context.instance()
        self._authenticator: ThreadAuthenticator | None = None
        if credentials is not None:
            self._context = zmq.Context()
            self._authenticator = admit_only(self._context, credentials)
        self._socket: zmq.Socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_server(self._socket, credentials)  # plain text: still only the cluster's senders
        # A larger frame never reaches us: ZMQ drops its sender's connection. Under CURVE the
        # limit applies to the encrypted message, a page frame plus its box's framing.
        max_frame = max(min(PAGE_FRAME_BYTES, self.max_payload_bytes), self.max_header_bytes)
        encrypts = credentials is not None and credentials.encrypts
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame + (CURVE_FRAMING if encrypts else 0))
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
                try:
                    ack = self._receive_one()
                except Exception as exc:  # a malformed message must not stop the receiver
                    log.warning("malformed KV transfer refused: %r", exc)
                    ack = pb.KVAckMsg(ok=False, error=f"malformed transfer: {type(exc).__name__}")
                self._drain()
                if ack is not None:
                    self._socket.send_multipart([identity, ack.SerializeToString()])
        self._socket.close(0)

    def _drain(self) -> None:
        """Discard what is left of the current message."""
        while self._socket.getsockopt(zmq.RCVMORE):
            self._socket.recv()

    def _receive_one(self) -> pb.KVAckMsg | None:
        """The answer to one message; None: broken on purpose, no answer."""
        if not self._socket.getsockopt(zmq.RCVMORE):
            return pb.KVAckMsg(ok=False, error="malformed transfer: no header")
        try:
            header = self.parse_header(self._socket.recv(copy=False).buffer)
        except ValueError as exc:  # too large to parse (a DecodeError is answered by _serve)
            return pb.KVAckMsg(ok=False, error=f"malformed transfer: {exc}")
        request_id = header.state.request_id
        if self.breaker.take():
            self.report_broken(request_id, INJECTED_BREAK)
            return None
        error = self.handshake(header)  # before any buffer is sized by the header
        if error is not None:
            return pb.KVAckMsg(request_id=request_id, ok=False, error=error)
        if header.shm_name:
            return self._receive_shared(header)
        if header.num_bytes > self._buffer.numel():
            self._buffer = torch.empty(header.num_bytes, dtype=torch.uint8)
        error = self._receive_pages(header.num_bytes)
        if error is not None:
            self.report_broken(request_id, error)  # its pages will not come: free its blocks
            return pb.KVAckMsg(request_id=request_id, ok=False, error=error)
        return self._deliver(header, self._buffer, FRAMES)

    def _receive_pages(self, num_bytes: int) -> str | None:
        """Receive the page frames into the buffer: each ``PAGE_FRAME_BYTES`` (the last one the
        rest), no more frames than that takes. The refusal, if the frames are not those."""
        view = byte_view(self._buffer)
        received = 0
        while received < num_bytes and self._socket.getsockopt(zmq.RCVMORE):
            expected = min(PAGE_FRAME_BYTES, num_bytes - received)
            size = self._socket.recv_into(view[received : received + expected])
            if size != expected:  # recv_into truncates a longer frame: refused either way
                return f"malformed transfer: a page frame of {size} bytes, expected {expected}"
            received += size
        if received != num_bytes:
            return f"expected {num_bytes} bytes, got {received}"
        if self._socket.getsockopt(zmq.RCVMORE):
            return "malformed transfer: more frames than its header announced"
        return None

    def _receive_shared(self, header: pb.KVHeaderMsg) -> pb.KVAckMsg:
        self._drain()
        try:
            pages = self._shared.view(header.shm_name, header.num_bytes)
        except (OSError, ValueError) as exc:
            return pb.KVAckMsg(
                request_id=header.state.request_id, ok=False, error=f"{SHM_UNAVAILABLE}: {exc}"
            )
        return self._deliver(header, pages, SHARED_MEMORY)

    def _deliver(self, header: pb.KVHeaderMsg, data: torch.Tensor, path: str) -> pb.KVAckMsg:
        error = self.accept(decode_payload(header, data), path)
        return pb.KVAckMsg(request_id=header.state.request_id, ok=error is None, error=error or "")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._context.term()


@dataclass(eq=False)
class _Connection:
    """A sender's state for one endpoint: its socket and, same host, its shared file."""

    socket: zmq.Socket
    lock: threading.Lock = field(default_factory=threading.Lock)  # one transfer at a time
    shared: SharedPageBuffer | None = None
    frames_only: bool = False  # the receiver cannot map our files (another host)

    def close(self) -> None:
        self.socket.close(0)
        if self.shared is not None:
            self.shared.close()
            self.shared = None


class ZmqKVSender(BaseKVSender):
    def __init__(
        self, shared_memory: bool = True, credentials: KVCredentials | None = None
    ) -> None:
        """``shared_memory=False``: the pages always go as frames, as between hosts."""
        super().__init__()
        self._use_shared_memory = shared_memory
        self._credentials = credentials
        self._context: zmq.Context = zmq.Context.instance()
        self._connections: EndpointCache[_Connection] = EndpointCache(
            self._connect, _Connection.close
        )

    def _connect(self, endpoint: str) -> _Connection:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        secure_client(socket, self._credentials)
        socket.connect(endpoint)
        return _Connection(socket)

    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> str:
        deadline = _Deadline(timeout)
        while True:
            with self._connections.lease(endpoint) as link, link.conn.lock:
                if link.discarded:  # the transfer before ours broke it: take a fresh one
                    continue
                return self._send_over(endpoint, link, payload, deadline)

    def _send_over(
        self, endpoint: str, link: Link[_Connection], payload: KVPayload, deadline: _Deadline
    ) -> str:
        try:
            return self._transfer(link.conn, endpoint, payload, deadline)
        except KVRefusedError:
            raise
        except Exception as exc:  # the socket's state is unknown now: never reuse it
            self._connections.discard(endpoint, link)
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"{type(exc).__name__}: {exc}") from exc

    def _transfer(
        self, conn: _Connection, endpoint: str, payload: KVPayload, deadline: _Deadline
    ) -> str:
        header = encode_header(payload)
        for _ in range(2):  # a receiver that dropped its mapping gets a fresh file once
            shared = self._shared_buffer(conn, endpoint, payload.num_bytes)
            if shared is None:
                break
            shared.write(payload.blocks)
            header.shm_name = shared.name
            ack = self._exchange(conn.socket, endpoint, [header.SerializeToString()], deadline)
            if ack.ok or not ack.error.startswith(SHM_UNAVAILABLE):
                shared.is_mapped_by_receiver = True
                return self._check(ack, SHARED_MEMORY)
            shared.close()
            conn.shared = None
            if not shared.is_mapped_by_receiver:
                conn.frames_only = True  # never could map it: another host; frames from now on
                break
        header.shm_name = ""
        pages = page_bytes(payload)
        frames = [header.SerializeToString()] + [
            pages[start : start + PAGE_FRAME_BYTES]
            for start in range(0, len(pages), PAGE_FRAME_BYTES)
        ]
        return self._check(self._exchange(conn.socket, endpoint, frames, deadline), FRAMES)

    def _shared_buffer(
        self, conn: _Connection, endpoint: str, num_bytes: int
    ) -> SharedPageBuffer | None:
        if not self._use_shared_memory or conn.frames_only:
            return None
        current = conn.shared
        if current is not None and current.num_bytes >= num_bytes:
            return current
        try:
            fresh = SharedPageBuffer(num_bytes)
        except OSError as exc:
            log.info("no shared-memory hand-off to %s: %s", endpoint, exc)
            conn.frames_only = True
            return None
        if current is not None:
            current.close()
        conn.shared = fresh
        return fresh

    def _check(self, ack: pb.KVAckMsg, path: str) -> str:
        if not ack.ok:
            raise KVRefusedError(ack.error)
        self.payloads_by_path.add(path)
        return path

    def _exchange(
        self, socket: zmq.Socket, endpoint: str, frames: list, deadline: _Deadline
    ) -> pb.KVAckMsg:
        socket.setsockopt(zmq.SNDTIMEO, deadline.millis_left())
        socket.send_multipart(frames, copy=False)
        if not socket.poll(deadline.millis_left(), zmq.POLLIN):
            raise KVTransferError(f"no answer from {endpoint} within {deadline.timeout:.1f} s")
        ack = pb.KVAckMsg()
        ack.ParseFromString(socket.recv(zmq.NOBLOCK))
        return ack

    def close(self) -> None:
        self._connections.close()


class _Deadline:
    """A transfer's time limit, shared by its exchanges (a shared-memory try, then frames)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.at = time.monotonic() + timeout

    def millis_left(self) -> int:
        return max(int((self.at - time.monotonic()) * 1000), 0)
