"""The transport interface. A sender pushes one :class:`KVPayload` to a receiver's endpoint and
returns when the receiver answered; a receiver hands each payload to its handler, whose
``None`` (installed) or error text (refused) goes back as the acknowledgement.

Both sides count the payloads installed by the path their pages took (``PATHS``), for tests and
metrics to tell which path a transport actually used."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable

from engine.transfer.payload import KVLayout, KVPayload

# Called on the receiver with the header's layout first (the handshake), then with the payload.
# Each returns None to accept or an error message to refuse.
PayloadHandler = Callable[[KVLayout | KVPayload], str | None]

SHARED_MEMORY = "shared_memory"  # zmq, one host: a /dev/shm file; only the header on the socket
FRAMES = "frames"  # zmq: the pages as one frame of the message
CHUNKS = "chunks"  # grpc: the pages streamed in 4 MiB chunks
DIRECT = "direct"  # inprocess: a function call
PATHS = (SHARED_MEMORY, FRAMES, CHUNKS, DIRECT)


class KVTransferError(Exception):
    """The hand-off did not complete: refused by the receiver, timed out or connection lost."""


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


class BaseKVSender(ABC):
    def __init__(self) -> None:
        self.payloads_by_path = PathCounts()  # acknowledged as installed

    @abstractmethod
    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> None:
        """Deliver ``payload``; raise :class:`KVTransferError` unless the receiver installed it."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release sockets and channels."""


class BaseKVReceiver(ABC):
    endpoint: str

    def __init__(self) -> None:
        self.payloads_by_path = PathCounts()  # accepted by the handler

    @abstractmethod
    def close(self) -> None:
        """Stop serving."""
