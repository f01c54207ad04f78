"""What the two sides of the KV hand-off share: their transfer settings and their share of the
KV plane's credentials, checked before the model loads (a worker that cannot join an encrypted
plane fails at once, not after a minute of loading weights). Each side opens its end of the
plane in :meth:`HandoffWorker.open_kv_plane`."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig, KVTransferConfig, kv_bind_address
from engine.transfer import KVCredentials
from engine.transfer.security import transfer_credentials
from workers.runtime import WorkerRuntime


class HandoffWorker(WorkerRuntime):
    def __init__(
        self,
        config: EngineConfig,
        transfer: KVTransferConfig,
        credentials: KVCredentials | None = None,
        **runtime: Any,
    ) -> None:
        """``credentials``: this side's share, required when ``transfer`` is encrypted;
        ``runtime``: :class:`WorkerRuntime`'s ``instance`` and ``cpu_ids``."""
        self.credentials = transfer_credentials(transfer, credentials)
        # the token channel binds beside the KV plane, admitting the same peers
        host = kv_bind_address(transfer.host) if self.credentials else "127.0.0.1"
        super().__init__(config, channel_host=host, channel_credentials=self.credentials, **runtime)
        self.transfer = transfer
        self.open_kv_plane()

    def open_kv_plane(self) -> None:
        """Start this side's end of the KV plane (a sender or a receiver)."""
        raise NotImplementedError
