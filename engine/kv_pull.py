"""Prompt prefixes pulled from a peer worker over the KV plane, instead of computed.

A worker about to compute a prompt whose leading blocks a peer holds (the router's cost model
says when: ``coordinator/routing/pull_cost.py``) *opens a pull* (:meth:`PrefixPulls.open`, engine
thread): the leading blocks its own cache holds are taken (kept while the rest come), free blocks
are set aside for the rest, and the pull gets an id, a secret and a deadline. The peer exports
those blocks (:func:`export_prefix`, its engine thread: from its cache, then its KV tiers) and
sends them to the puller's pull endpoint as a hand-off's pages go: the same transports,
credentials, size bounds and layout check. The puller's receiver thread checks the header
against the pull (its secret, the layout, no more blocks than set aside), then the pages (the
prefix's own tokens, starting where the puller's cache stopped), writes them into the blocks set
aside, and the engine thread caches them under their hashes and frees them
(:meth:`PrefixPulls.finish`): the prompt that follows finds them in the prefix cache like blocks
it computed. A peer that no longer holds the whole run sends the part it holds. A pull that
fails, is cancelled, or whose pages do not come by its deadline frees its blocks: the prompt
computes them.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.errors import KVImportError
from engine.sampling_params import SamplingParams
from engine.transfer.payload import HandoffState, KVPayload, TransferHeader

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

PULL_PREFIX = "pull-"  # a pull's id starts with this


@dataclass(frozen=True)
class PullTicket:
    """What the peer is told: where to send which blocks, with which secret."""

    pull_id: str
    secret: str = field(repr=False)
    first_block: int  # the puller's cache holds the blocks before this one
    num_blocks: int  # blocks set aside for the pages, from ``first_block`` on


@dataclass
class _Pull:
    ticket: PullTicket
    tenant: str
    token_ids: list[int]  # the tokens of blocks [0, first_block + num_blocks)
    hashes: list[bytes]
    block_ids: list[int]  # the cached blocks taken, then the blocks set aside
    deadline: float
    receiving: bool = False


@dataclass
class PullStats:
    opened: int = 0
    pulled_blocks: int = 0  # blocks installed from peers
    failed: int = 0  # pulls that ended with no page installed (refused, expired, cancelled)
    exported_blocks: int = 0  # blocks sent to peers


class PrefixPulls:
    """The engine's pulls (``engine.pulls``): the engine thread opens and ends them, the
    transport thread checks and writes their pages under ``_lock``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.blocks, self.kv_cache, self.layout = engine.blocks, engine.kv_cache, engine.layout
        self._pulls: dict[str, _Pull] = {}
        self._lock = threading.Lock()
        self.stats = PullStats()

    def open(
        self, token_ids: list[int], tenant: str, num_blocks: int, timeout_s: float
    ) -> PullTicket | None:
        """Engine thread: set blocks aside for the first ``num_blocks`` blocks of
        ``token_ids`` (never the block of its last token, which a prompt computes) that this
        cache lacks; None when it holds them all, or has no room for the rest."""
        blocks, size = self.blocks, self.blocks.block_size
        num_blocks = min(num_blocks, max(len(token_ids) - 1, 0) // size)
        if not blocks.enabled or num_blocks <= 0:
            return None
        tokens = list(token_ids[: num_blocks * size])
        hashes = blocks.extend_hashes([], tokens, len(tokens), tenant)
        held = blocks.match(hashes, tokens, num_blocks, tenant)
        missing = num_blocks - len(held)
        if missing <= 0 or not blocks.can_take(held, missing):
            return None
        ticket = PullTicket(PULL_PREFIX + secrets.token_hex(8), secrets.token_hex(16),
                            len(held), missing)  # fmt: skip
        block_ids = blocks.take(held) + blocks.allocate(missing)
        pull = _Pull(ticket, tenant, tokens, hashes, block_ids, time.monotonic() + timeout_s)
        with self._lock:
            self._pulls[ticket.pull_id] = pull
        self.stats.opened += 1
        return ticket

    # ---- the transport thread ------------------------------------------------------------------

    def check_header(self, header: TransferHeader) -> None:
        """The handshake: a live pull with the header's secret, our layout, and pages that fit
        the blocks set aside. Raises :class:`KVImportError`."""
        with self._lock:
            pull = self._live(header.request_id, header.token)
            self.layout.check_compatible(header.layout)
            self._check_shape(pull, header.shape)

    def take(self, payload: KVPayload) -> _Pull:
        """The pull the pages are for, checked whole (their tokens are the prefix's, from the
        block the puller's cache stopped at), marked as receiving."""
        state = payload.state
        with self._lock:
            pull = self._live(state.request_id, payload.token)
            self.layout.check_compatible(payload.layout)
            num_blocks = self._check_shape(pull, tuple(payload.blocks.shape))
            first = pull.ticket.first_block
            if state.first_block != first:
                raise KVImportError(f"pages start at block {state.first_block}, not {first}")
            end = (first + num_blocks) * self.blocks.block_size
            if state.token_ids != pull.token_ids[:end]:
                raise KVImportError("the pages' tokens are not the prefix pulled")
            pull.receiving = True
        return pull

    def write(self, pull: _Pull, payload: KVPayload) -> str | None:
        """Copy the pages into the pull's blocks; the error, if the copy failed."""
        first, num_blocks = pull.ticket.first_block, payload.blocks.shape[2]
        try:
            with torch.inference_mode():
                self.kv_cache.import_blocks(pull.block_ids[first : first + num_blocks],
                                            payload.blocks)  # fmt: skip
        except RuntimeError as exc:
            return f"KV install failed: {exc}"
        return None

    def _live(self, pull_id: str, secret: str) -> _Pull:
        pull = self._pulls.get(pull_id)
        expected = pull.ticket.secret if pull is not None else ""
        if (
            pull is None
            or pull.receiving
            or not hmac.compare_digest(secret.encode(), expected.encode())
        ):
            raise KVImportError("no pull awaits these pages (expired?)")
        return pull

    def _check_shape(self, pull: _Pull, shape: tuple[int, ...]) -> int:
        num_blocks = shape[2] if len(shape) == 6 else 0
        if shape != self.layout.page_shape(num_blocks) or num_blocks < 1:
            raise KVImportError(f"KV blocks have shape {shape}, expected "
                                f"{self.layout.page_shape(pull.ticket.num_blocks)}")  # fmt: skip
        if num_blocks > pull.ticket.num_blocks:
            raise KVImportError(f"{num_blocks} blocks arrived, {pull.ticket.num_blocks} set aside")
        return num_blocks

    # ---- the engine thread ---------------------------------------------------------------------

    def finish(self, pull: _Pull, num_blocks: int, error: str | None) -> int:
        """After ``write``: cache the ``num_blocks`` blocks that came (none on ``error``) and
        free the pull's blocks; the blocks installed."""
        with self._lock:
            self._pulls.pop(pull.ticket.pull_id, None)
        installed = 0 if error is not None else num_blocks
        if installed:
            end = pull.ticket.first_block + installed
            self.blocks.register(pull.block_ids[:end], pull.hashes[:end], pull.token_ids,
                                 pull.ticket.first_block, pull.tenant)  # fmt: skip
        self.blocks.free(pull.block_ids)
        self.stats.pulled_blocks += installed
        self.stats.failed += not installed
        return installed

    def cancel(self, pull_id: str) -> bool:
        """End a pull whose pages are not coming (the peer failed): its blocks are freed, unless
        its pages are being written (then ``finish`` frees them)."""
        with self._lock:
            pull = self._pulls.get(pull_id)
            if pull is None or pull.receiving:
                return False
            del self._pulls[pull_id]
        self.blocks.free(pull.block_ids)
        self.stats.failed += 1
        return True

    def expire(self, now: float) -> None:
        """End every pull past its deadline with no pages."""
        with self._lock:
            late = [p for p in self._pulls.values() if p.deadline < now and not p.receiving]
        for pull in late:
            self.cancel(pull.ticket.pull_id)

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._pulls)


def export_prefix(
    engine: LLMEngine, token_ids: list[int], tenant: str, ticket: PullTicket
) -> KVPayload | None:
    """Engine thread, on the peer: the pages of the ticket's blocks of ``token_ids`` that this
    worker holds, as one payload (its cache first, then its KV tiers), from the ticket's first
    block up to the first block it lacks; None when it holds not even the first."""
    blocks, size = engine.blocks, engine.blocks.block_size
    first, stop = ticket.first_block, ticket.first_block + ticket.num_blocks
    if first < 0 or ticket.num_blocks < 1 or stop * size > len(token_ids):
        raise ValueError(f"blocks [{first}, {stop}) are not within the {len(token_ids)} tokens")
    tokens = list(token_ids[: stop * size])
    hashes = blocks.extend_hashes([], tokens, len(tokens), tenant)
    held = blocks.match(hashes, tokens, stop, tenant)
    parts, end = [], first
    if len(held) > first:
        parts.append(engine.kv_cache.export_blocks(held[first:]))
        end = len(held)
    tiers = engine.tiers
    if tiers is not None and end < stop:
        root = blocks.root_of(tenant)
        found = tiers.find(hashes, tokens, end, stop, root, size, keep=True)  # sent later
        if found:
            parts.append(found.pages)
            end += len(found)
    if end == first:
        return None
    # one contiguous buffer whatever its parts (a tier's pages are a view across blocks): the
    # transports send its bytes as they lie
    pages = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).contiguous()
    state = HandoffState(
        request_id=ticket.pull_id,
        token_ids=tokens[: end * size],
        num_prompt_tokens=end * size,
        num_computed_tokens=end * size,
        params=SamplingParams(),
        priority=0,
        first_block=first,
    )
    engine.pulls.stats.exported_blocks += end - first
    return KVPayload(engine.layout, state, pages, ticket.secret)
