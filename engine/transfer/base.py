"""The transport interface. A sender pushes one :class:`KVPayload` to a receiver's endpoint and
returns when the receiver answered; a receiver hands each payload to its handler, whose
``None`` (installed) or error text (refused) goes back as the acknowledgement.

A receiver that learns a transfer broke after its header (the stream was cut, or fault
injection broke it) tells its ``on_broken`` callback which request it was, so that the request's
reservation can be freed at once. Fault injection itself (``break_next``) is for chaos tests: the
receiver breaks its next transfers the way a network break looks to the sender.

Both sides count the payloads installed by the path their pages took (``PATHS``), for tests and
metrics to tell which path a transport actually used.

A receiver cannot be knocked over by what arrives: every message is handled in its own error
boundary and answered (a refusal for anything malformed), and nothing is sized by a header before
the handshake accepted it: the header itself at most ``max_header_bytes`` (checked before it is
parsed), consistent with itself, its page buffer at most ``max_payload_bytes`` (the receiver's
whole KV cache), and the handler (the reservation) must accept it. Pages travel in pieces of at
most ``PAGE_FRAME_BYTES``, so no transport takes a larger piece than that or the header."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.transfer.codec import decode_header
from engine.transfer.payload import KVPayload, TransferHeader
from engine.transfer.proto import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

# Called on the receiver with the header first (the handshake, before any page is read), then
# with the payload. Each returns None to accept or an error message to refuse.
PayloadHandler = Callable[[TransferHeader | KVPayload], str | None]
# Called on the receiver with (request id, why) when a transfer broke after its header.
BrokenHandler = Callable[[str, str], None]

SHARED_MEMORY = "shared_memory"  # zmq, one host: a /dev/shm file; only the header on the socket
FRAMES = "frames"  # zmq: the pages as one frame of the message
CHUNKS = "chunks"  # grpc: the pages streamed in 4 MiB chunks
DIRECT = "direct"  # inprocess: a function call
PATHS = (SHARED_MEMORY, FRAMES, CHUNKS, DIRECT)

INJECTED_BREAK = "transport broken by fault injection"
# Default bound on one transfer's pages, for receivers not told their cache's size.
DEFAULT_MAX_PAYLOAD_BYTES = 4 * 2**30
# A header's room besides its token ids (layout, counts, sampling parameters, secret) ...
MAX_HEADER_BYTES = 64 * 2**10
# ... and per token id it carries (a varint of at most 10 bytes): see ``header_limit``.
HEADER_BYTES_PER_TOKEN = 10
# Pages travel in frames (zmq) or chunks (grpc) of at most this many bytes each.
PAGE_FRAME_BYTES = 4 * 2**20
# The header limit of a receiver not told its engine's longest sequence.
DEFAULT_MAX_TOKENS = 1 << 16


def header_limit(max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """The largest header a receiver takes: ``MAX_HEADER_BYTES`` plus room for the token ids of
    its engine's longest sequence (``max_tokens``); a larger one is refused unparsed."""
    return MAX_HEADER_BYTES + HEADER_BYTES_PER_TOKEN * max_tokens


class KVTransferError(Exception):
    """The hand-off did not complete: refused by the receiver, timed out or connection lost."""


class KVRefusedError(KVTransferError):
    """The receiver answered, refusing the pages: the connection itself is sound."""


class PathCounts:
    """Payloads installed, by the path their pages took (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, path: str) -> None:
        with self._lock:
            self._counts[path] += 1

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class TransferBreaker:
    """How many of the next incoming transfers to break (fault injection; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0

    def arm(self, count: int) -> int:
        """Break ``count`` more transfers; returns how many are now pending."""
        with self._lock:
            self._pending += count
            return self._pending

    def take(self) -> bool:
        """Whether to break the transfer at hand (counts it)."""
        with self._lock:
            if self._pending == 0:
                return False
            self._pending -= 1
            return True


class BaseKVSender(ABC):
    def __init__(self) -> None:
        self.payloads_by_path = PathCounts()  # acknowledged as installed

    @abstractmethod
    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> str:
        """Deliver ``payload`` within ``timeout`` seconds and return the path its pages took
        (``PATHS``); raise :class:`KVTransferError` unless the receiver installed it
        (:class:`KVRefusedError` when the receiver refused it)."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release sockets and channels."""


@dataclass(frozen=True)
class ReceiverLimits:
    """What a receiver bounds before it reads: page buffers over ``max_payload_bytes`` (its KV
    cache), headers over ``max_header_bytes`` (``header_limit()`` of its longest sequence), and a
    gRPC push still unfinished after ``stream_timeout_s`` (the senders' transfer timeout)."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_header_bytes: int = field(default_factory=header_limit)
    stream_timeout_s: float = 10.0


class BaseKVReceiver(ABC):
    endpoint: str

    def __init__(
        self,
        handler: PayloadHandler,
        on_broken: BrokenHandler | None = None,
        limits: ReceiverLimits | None = None,
    ) -> None:
        self.payloads_by_path = PathCounts()  # accepted by the handler
        self.breaker = TransferBreaker()
        self.limits = limits or ReceiverLimits()
        self.max_payload_bytes = self.limits.max_payload_bytes
        self.max_header_bytes = self.limits.max_header_bytes
        self._handler = handler
        self._on_broken = on_broken

    def handshake(self, header: pb.KVHeaderMsg) -> str | None:
        """Check a header before any page is read or any buffer sized for it: its consistency,
        the size bound, then the handler. None to go on, else the refusal."""
        try:
            view = decode_header(header)
        except ValueError as exc:
            return f"malformed transfer: {exc}"
        if view.num_bytes > self.max_payload_bytes:
            return f"malformed transfer: {view.num_bytes} bytes exceed the receiver's KV cache"
        return self._handler(view)

    def parse_header(self, data: bytes | memoryview) -> pb.KVHeaderMsg:
        """The header frame parsed, if it is within ``max_header_bytes`` (checked before
        parsing); raises ValueError otherwise."""
        if len(data) > self.max_header_bytes:
            raise ValueError(
                f"header of {len(data)} bytes exceeds the receiver's {self.max_header_bytes}"
            )
        header = pb.KVHeaderMsg()
        header.ParseFromString(data)
        return header

    def accept(self, payload: KVPayload, path: str) -> str | None:
        """Hand the received payload to the handler; counts it under ``path`` if accepted."""
        error = self._handler(payload)
        if error is None:
            self.payloads_by_path.add(path)
        return error

    def break_next(self, count: int) -> int:
        """Fault injection: break the next ``count`` incoming transfers mid-stream, as a network
        break would (see the transport). Returns how many breaks are pending."""
        return self.breaker.arm(count)

    def report_broken(self, request_id: str, error: str) -> None:
        """Tell ``on_broken`` that ``request_id``'s transfer broke after its header."""
        if self._on_broken is None or not request_id:
            return
        try:
            self._on_broken(request_id, error)
        except Exception:  # the receiver thread must go on serving
            log.exception("on_broken failed for request %s", request_id)

    @abstractmethod
    def close(self) -> None:
        """Stop serving."""
