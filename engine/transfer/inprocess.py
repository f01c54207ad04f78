"""In-process transport for unit tests: the sender calls the receiver's handler directly.

Fault injection (``break_next``): the call fails as a lost connection would, after the header."""

from __future__ import annotations

import itertools

from engine.transfer.base import (
    DIRECT,
    INJECTED_BREAK,
    BaseKVReceiver,
    BaseKVSender,
    BrokenHandler,
    KVRefusedError,
    KVTransferError,
    PayloadHandler,
)
from engine.transfer.payload import KVPayload, TransferHeader

_IDS = itertools.count()


class InProcessKVReceiver(BaseKVReceiver):
    def __init__(self, handler: PayloadHandler, on_broken: BrokenHandler | None = None) -> None:
        super().__init__(handler, on_broken)
        self.endpoint = f"inprocess://{next(_IDS)}"
        _RECEIVERS[self.endpoint] = self

    def deliver(self, payload: KVPayload) -> str | None:
        """The handshake, then a copy of the pages (as if they had crossed): None or the refusal.
        Raises :class:`KVTransferError` for a transfer broken on purpose."""
        if self.breaker.take():
            self.report_broken(payload.state.request_id, INJECTED_BREAK)
            raise KVTransferError(INJECTED_BREAK)
        header = TransferHeader(
            payload.layout,
            payload.state.request_id,
            payload.token,
            tuple(payload.blocks.shape),
            payload.num_bytes,
        )
        copy = KVPayload(payload.layout, payload.state, payload.blocks.clone(), payload.token)
        return self._handler(header) or self.accept(copy, DIRECT)

    def close(self) -> None:
        _RECEIVERS.pop(self.endpoint, None)


_RECEIVERS: dict[str, InProcessKVReceiver] = {}


class InProcessKVSender(BaseKVSender):
    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> str:
        receiver = _RECEIVERS.get(endpoint)
        if receiver is None:
            raise KVTransferError(f"no receiver at {endpoint}")
        error = receiver.deliver(payload)
        if error is not None:
            raise KVRefusedError(error)
        self.payloads_by_path.add(DIRECT)
        return DIRECT
