"""The transport interface. A sender pushes one :class:`KVPayload` to a receiver's endpoint and
returns when the receiver answered; a receiver hands each payload to its handler, whose
``None`` (installed) or error text (refused) goes back as the acknowledgement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from engine.transfer.payload import KVLayout, KVPayload

# Called on the receiver with the header's layout first (the handshake), then with the payload.
# Each returns None to accept or an error message to refuse.
PayloadHandler = Callable[[KVLayout | KVPayload], str | None]


class KVTransferError(Exception):
    """The hand-off did not complete: refused by the receiver, timed out or connection lost."""


class BaseKVSender(ABC):
    @abstractmethod
    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> None:
        """Deliver ``payload``; raise :class:`KVTransferError` unless the receiver installed it."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release sockets and channels."""


class BaseKVReceiver(ABC):
    endpoint: str

    @abstractmethod
    def close(self) -> None:
        """Stop serving."""
