"""In-process transport for unit tests: the sender calls the receiver's handler directly."""

from __future__ import annotations

import itertools

from engine.transfer.base import BaseKVReceiver, BaseKVSender, KVTransferError, PayloadHandler
from engine.transfer.payload import KVPayload

_RECEIVERS: dict[str, PayloadHandler] = {}
_IDS = itertools.count()


class InProcessKVReceiver(BaseKVReceiver):
    def __init__(self, handler: PayloadHandler) -> None:
        self.endpoint = f"inprocess://{next(_IDS)}"
        _RECEIVERS[self.endpoint] = handler

    def close(self) -> None:
        _RECEIVERS.pop(self.endpoint, None)


class InProcessKVSender(BaseKVSender):
    def send(self, endpoint: str, payload: KVPayload, timeout: float) -> None:
        handler = _RECEIVERS.get(endpoint)
        if handler is None:
            raise KVTransferError(f"no receiver at {endpoint}")
        error = handler(payload.layout) or handler(
            KVPayload(payload.layout, payload.state, payload.blocks.clone())
        )
        if error is not None:
            raise KVTransferError(error)
