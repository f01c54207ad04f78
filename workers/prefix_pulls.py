"""A worker's end of peer prefix pulls (``engine/kv_pull.py``; ``kv_peer_pull`` on): a prefill
worker takes a prompt's leading blocks from a peer that holds them, any worker sends them.

The coordinator drives a pull in two calls before the prompt goes to the prefill worker: the
puller's ``open_pull`` sets blocks aside and answers a :class:`PullOffer` (its pull endpoint and
the ticket); the holder's ``send_prefix`` exports the blocks on its engine thread and pushes
them to that endpoint, answering once the puller acknowledged them (:class:`PrefixSent`). The
pages travel on the KV plane's own transports, with its credentials: the puller's receiver holds
the receivers' share (it admits only the cluster's senders), the holder sends with the senders'
share. The puller caches what came before its acknowledgement leaves, so the prompt that follows
finds those blocks; a pull that fails costs the prompt nothing but its compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import KVImportError
from engine.openmp import serial_here
from engine.transfer.base import BaseKVSender, KVTransferError, PayloadHandler
from engine.transfer.payload import KVPayload, TransferHeader

if TYPE_CHECKING:  # the engine's modules: a coordinator imports this one without torch
    from engine.kv_pull import PullTicket
    from engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class PullOffer:
    """Where a peer sends a prefix, and which blocks: the puller's answer to ``open_pull``."""

    endpoint: str
    ticket: PullTicket


@dataclass(frozen=True)
class PrefixSent:
    """What a peer's ``send_prefix`` did: blocks delivered (0: none, ``error`` says why)."""

    num_blocks: int
    num_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


LoopCall = Callable[[Callable[["LLMEngine"], object]], object]


def pull_handler(engine: LLMEngine, call_engine: LoopCall) -> PayloadHandler:
    """The pull receiver's handler: the header checked against its pull, then the pages
    written into the blocks set aside right on the transport thread, and cached by the engine
    thread before the acknowledgement leaves (``call_engine`` queues work there)."""

    def on_transfer(item: TransferHeader | KVPayload) -> str | None:
        serial_here()  # the copy's parallel regions on this thread alone (engine/openmp.py)
        try:
            if isinstance(item, TransferHeader):
                engine.pulls.check_header(item)
                return None
            pull = engine.pulls.take(item)
        except KVImportError as exc:
            return str(exc)
        error: str | None = "KV install failed"
        try:
            error = engine.pulls.write(pull, item)
        finally:  # queued before the acknowledgement: the prompt sent next finds the blocks
            num_blocks = item.blocks.shape[2]
            call_engine(lambda e: e.pulls.finish(pull, num_blocks, error))
        return error

    return on_transfer


def send_prefix(
    engine_call: Callable[[Callable[[LLMEngine], KVPayload | None]], KVPayload | None],
    sender: BaseKVSender,
    token_ids: list[int],
    tenant: str,
    offer: PullOffer,
    timeout_s: float,
) -> PrefixSent:
    """Export the offer's blocks (on the engine thread, by ``engine_call``) and push them to the
    puller within ``timeout_s``."""
    from engine.kv_pull import export_prefix

    start = time.monotonic()
    try:
        payload = engine_call(lambda e: export_prefix(e, token_ids, tenant, offer.ticket))
    except ValueError as exc:
        return PrefixSent(0, error=str(exc))
    if payload is None:
        return PrefixSent(0, error="this worker holds none of those blocks now")
    left = timeout_s - (time.monotonic() - start)
    try:
        if left <= 0:
            raise KVTransferError(f"exported too late: {timeout_s:.1f} s passed")
        sender.send(offer.endpoint, payload, left)
    except KVTransferError as exc:
        return PrefixSent(0, error=f"pull refused or lost: {exc}")
    seconds = time.monotonic() - start
    return PrefixSent(payload.blocks.shape[2], payload.num_bytes, seconds)
