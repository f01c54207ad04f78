"""What the two sides of the KV hand-off share: their transfer settings and their share of the
KV plane's credentials, checked before the model loads (a worker that cannot join an encrypted
plane fails at once, not after a minute of loading weights). Each side opens its end of the
plane in :meth:`HandoffWorker.open_kv_plane`.

With ``kv_peer_pull`` on, both sides also take part in peer prefix pulls
(``workers/prefix_pulls.py``): a prefill worker opens a second receiver, for the prefixes it
pulls (with the receivers' share of the credentials, ``pull_credentials``), and any worker sends
the prefixes it holds (a decode worker with a sender of its own, holding the senders' share)."""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig, KVTransferConfig, kv_bind_address
from engine.transfer.base import BaseKVReceiver, BaseKVSender, ReceiverLimits, header_limit
from engine.transfer.security import KVCredentials, transfer_credentials
from engine.transfer.transports import create_receiver
from workers.prefix_pulls import PrefixSent, PullOffer, pull_handler, send_prefix
from workers.runtime import CONTROL, HANDOFFS, WorkerRuntime, in_group


class HandoffWorker(WorkerRuntime):
    sender: BaseKVSender  # the prefill side's, and a decode worker's when it sends prefixes
    pull_receiver: BaseKVReceiver | None = None  # where peers send the prefixes pulled here

    def __init__(
        self,
        config: EngineConfig,
        transfer: KVTransferConfig,
        credentials: KVCredentials | None = None,
        pull_credentials: KVCredentials | None = None,
        **runtime: Any,
    ) -> None:
        """``credentials``: this side's share, required when ``transfer`` is encrypted;
        ``pull_credentials``: the other share, for peer pulls (``kv_peer_pull``);
        ``runtime``: :class:`WorkerRuntime`'s ``instance`` and ``cpu_ids``."""
        self.credentials = transfer_credentials(transfer, credentials)
        if transfer.peer_pull:
            self.pull_credentials = transfer_credentials(transfer, pull_credentials)
        # the token channel binds beside the KV plane, admitting the same peers
        host = kv_bind_address(transfer.host) if self.credentials else "127.0.0.1"
        super().__init__(config, channel_host=host, channel_credentials=self.credentials, **runtime)
        self.transfer = transfer
        self.open_kv_plane()
        if transfer.peer_pull:
            self.open_pull_plane()

    def open_kv_plane(self) -> None:
        """Start this side's end of the KV plane (a sender or a receiver)."""
        raise NotImplementedError

    def open_pull_plane(self) -> None:
        """Start what this side needs for peer pulls beyond its end of the KV plane."""
        raise NotImplementedError

    def _pull_receiver(self) -> BaseKVReceiver:
        """A receiver for the prefixes pulled here, bounded as the hand-off's are."""
        transfer = self.transfer
        return create_receiver(
            transfer.transport,
            pull_handler(self.engine, self.loop.call),
            kv_bind_address(transfer.host),
            limits=ReceiverLimits(
                max_payload_bytes=self.engine.kv_cache_bytes,
                max_header_bytes=header_limit(self.engine.config.scheduler.max_seq_len),
                stream_timeout_s=transfer.transfer_timeout_s,
            ),
            credentials=self.pull_credentials,
        )

    @in_group(CONTROL)
    def open_pull(self, token_ids: list[int], tenant: str, num_blocks: int) -> PullOffer | None:
        """Set blocks aside for the first ``num_blocks`` blocks of ``token_ids`` that this
        worker's cache lacks, for a peer to send (``send_prefix``); None when it holds them,
        has no room, or takes no pulls. Unused, they are freed after ``transfer_timeout_s``."""
        receiver = self.pull_receiver
        if receiver is None:
            return None
        timeout_s = self.transfer.transfer_timeout_s
        ticket = self.loop.call(
            lambda e: e.pulls.open(token_ids, tenant, num_blocks, timeout_s)
        ).result()
        return None if ticket is None else PullOffer(receiver.endpoint, ticket)

    @in_group(CONTROL)
    def cancel_pull(self, pull_id: str) -> bool:
        """Free the blocks of a pull whose pages are not coming."""
        return bool(self.loop.call(lambda e: e.pulls.cancel(pull_id)).result())

    @in_group(HANDOFFS)
    def send_prefix(self, token_ids: list[int], tenant: str, offer: PullOffer) -> PrefixSent:
        """Send the offer's blocks of ``token_ids`` (``tenant``'s) that this worker holds to
        the puller, within ``transfer_timeout_s``."""
        sender = getattr(self, "sender", None)
        if sender is None:
            return PrefixSent(0, error="this worker sends no prefixes (kv_peer_pull is off)")

        timeout_s = self.transfer.transfer_timeout_s
        on_engine = lambda fn: self.loop.call(fn).result()  # noqa: E731
        return send_prefix(on_engine, sender, token_ids, tenant, offer, timeout_s)
