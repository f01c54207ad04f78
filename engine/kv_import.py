"""The decode side of a KV hand-off: :class:`KVImporter`, the engine's ``importer``.

``reserve_import`` sets blocks aside for a request whose pages are coming (RESERVED, with a
deadline), sharing the leading blocks the prefix cache holds (their pages are not sent);
``check_transfer_header`` and ``take_reservation`` + ``write_pages`` check and put the arriving
pages into the other blocks (RECEIVING; these alone may run on the transport's thread, under
``_receive_lock``); ``finish_receive`` starts the request decoding (RUNNING). A reservation ends
like any request: ``abort``, or ``expire_reservations`` once its deadline passed.
"""

from __future__ import annotations

import hmac
import threading
import time
from typing import TYPE_CHECKING

import torch

from engine.errors import KVImportError, RequestRejectedError
from engine.request import NewRequest, Request, RequestStatus, replay_outputs
from engine.transfer.payload import HandoffState, KVPayload, TransferHeader

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class KVImporter:
    """The engine's part that receives hand-offs (``engine.importer``): it owns
    ``receive_lock``, under which reservations change state; the engine owns everything else
    it touches."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config, self.shape, self.layout = engine.config, engine.shape, engine.layout
        self.blocks, self.kv_cache = engine.blocks, engine.kv_cache
        self.scheduler = engine.scheduler
        self.requests = engine.requests  # the engine's: a reservation is one of its requests
        # orders the transport thread's RESERVED -> RECEIVING against the engine thread ending
        # the request: blocks being written to are freed only once the write is over
        self.receive_lock = threading.Lock()

    def reserve_import(
        self,
        new: NewRequest,
        timeout_s: float | None = None,
        token: str = "",
        max_shared_blocks: int | None = None,
    ) -> Request | None:
        """Set blocks aside for the hand-off of ``new`` (its prompt, outputs so far, output limit
        and tenant as the coordinator said, never the pages): a RESERVED request, ended with an
        error if its pages are not in within ``timeout_s``; None when the cache cannot hold it
        now. Only pages carrying ``token`` (its secret) are taken. Its leading blocks in the
        prefix cache, the tenant's own (at most ``max_shared_blocks``), are shared
        (``num_shared_blocks``): the pages start after them."""
        if new.request_id in self.requests:
            raise RequestRejectedError(f"request id {new.request_id!r} is already in use")
        token_ids = new.token_ids
        hashes: list[bytes] = []
        shared, num_new = self._blocks_of(new, hashes, max_shared_blocks)
        if not self.blocks.can_take(shared, num_new):
            return None
        self.blocks.count_lookup(len(token_ids), len(shared))
        # Its first token comes with the pages, and its outputs so far are replayed then
        # (finish_receive).
        request = self.engine.new_request(
            new,
            replay=False,
            status=RequestStatus.RESERVED,
            block_hashes=hashes,
            block_ids=self.blocks.take(shared) + self.blocks.allocate(num_new),
            num_shared_blocks=len(shared),
            num_registered_blocks=len(shared),
            deadline=None if timeout_s is None else new.arrival_time + timeout_s,
            reservation_token=token,
        )
        with self.receive_lock:  # the transport's thread looks reservations up
            self.requests[new.request_id] = request
        return request

    def blocks_needed(self, new: NewRequest) -> int:
        """New blocks a reservation for ``new`` would take now: for its tokens so far and its
        next one, less the leading blocks its tenant's prefix cache holds."""
        return self._blocks_of(new, [])[1]

    def _blocks_of(
        self, new: NewRequest, hashes: list[bytes], max_shared: int | None = None
    ) -> tuple[list[int], int]:
        """The cached blocks a reservation for ``new`` shares (at most ``max_shared``; their
        hashes extend ``hashes``) and how many new ones it takes."""
        shared = self.blocks.lookup(hashes, new.token_ids, new.tenant)[:max_shared]
        return shared, self.blocks.blocks_for(len(new.token_ids) + 1) - len(shared)

    def reservation_refusal(self, num_tokens: int) -> str:
        """Why a reservation for ``num_tokens`` (prompt and outputs so far) does not fit now."""
        return (
            f"decode cache full: {self.blocks.num_free_blocks} of {self.blocks.num_blocks} "
            f"blocks free, {self.blocks.blocks_for(num_tokens + 1)} needed"
        )

    def expire_reservations(self, now: float | None = None) -> None:
        """End every RESERVED request past its deadline with an error (its pages never came)."""
        now = time.monotonic() if now is None else now
        for request in list(self.requests.values()):
            deadline = request.deadline
            if request.status == RequestStatus.RESERVED and deadline is not None and deadline < now:
                waited = deadline - request.arrival_time
                self.engine.abort(
                    request.request_id, f"KV pages did not arrive within {waited:.0f} s"
                )

    def check_transfer_header(self, header: TransferHeader) -> None:
        """Any thread: the handshake, before any page is read. Raises :class:`KVImportError`
        unless a live reservation with the header's secret awaits pages of this layout and
        shape."""
        with self.receive_lock:
            request = self._live_reservation(header.request_id, header.token)
            self.layout.check_compatible(header.layout)
            self._check_page_shape(request, header.shape)

    def take_reservation(self, payload: KVPayload) -> Request:
        """Any thread: check arriving pages against their reservation and mark it RECEIVING.

        Raises :class:`KVImportError` (the request keeps its reservation) for pages that have no
        live reservation with their secret or do not fit it: another model or layout, more
        blocks, another shape, or a request state at odds with the reservation (another prompt,
        token ids out of the vocabulary, counts that do not add up, an output limit the
        reservation's does not leave room in).
        """
        state = payload.state
        with self.receive_lock:
            request = self._live_reservation(state.request_id, payload.token)
            self.layout.check_compatible(payload.layout)
            self._check_page_shape(request, tuple(payload.blocks.shape))
            if state.first_block != request.num_shared_blocks:
                raise KVImportError(
                    f"pages start at block {state.first_block}; this worker holds "
                    f"{request.num_shared_blocks} leading blocks of the request"
                )
            payload.check_shape(
                self.blocks.blocks_for(state.num_computed_tokens) - state.first_block
            )
            self._check_state(request, state)
            request.status = RequestStatus.RECEIVING
            request.reservation_token = ""
        return request

    def _live_reservation(self, request_id: str, token: str) -> Request:
        """Under ``_receive_lock``: the RESERVED request whose secret is ``token``. Every miss
        gets the same answer, whatever was wrong."""
        request = self.requests.get(request_id)
        expected = request.reservation_token if request is not None else ""
        matches = hmac.compare_digest(token.encode(), expected.encode())
        if not matches or request is None or request.status != RequestStatus.RESERVED:
            raise KVImportError("no reservation for these pages (aborted?)")
        return request

    def _check_page_shape(self, request: Request, shape: tuple[int, ...]) -> None:
        num_blocks = shape[2] if len(shape) == 6 else 0
        expected = self.layout.page_shape(num_blocks)
        if shape != expected:
            raise KVImportError(f"KV blocks have shape {shape}, expected {expected}")
        reserved = len(request.block_ids) - request.num_shared_blocks
        if num_blocks > reserved:
            raise KVImportError(f"{num_blocks} blocks arrived, {reserved} reserved")

    def _check_state(self, request: Request, state: HandoffState) -> None:
        """The arriving state must continue the reserved request and fit its blocks: a forged
        one never reaches a step, where a bad token id would fail every running request."""
        num_prompt = request.num_prompt_tokens
        tokens = state.token_ids
        reserved = request.token_ids  # the prompt and any outputs so far
        if state.num_prompt_tokens != num_prompt or tokens[: len(reserved)] != reserved:
            raise KVImportError("the pages' tokens are not the reserved request's")
        computed = state.num_computed_tokens
        if computed < num_prompt or len(tokens) != computed + 1:
            raise KVImportError(
                f"inconsistent request state: {len(tokens)} tokens, {computed} computed"
            )
        if self.blocks.blocks_for(len(tokens)) > len(request.block_ids):
            raise KVImportError(f"{len(tokens)} tokens do not fit the reserved blocks")
        vocab_size = self.shape.vocab_size
        if any(not 0 <= t < vocab_size for t in tokens):
            raise KVImportError(f"a token id is outside the vocabulary (0..{vocab_size - 1})")
        num_outputs, max_output_tokens = len(tokens) - num_prompt, request.max_output_tokens
        if not num_outputs < max_output_tokens <= self.config.scheduler.max_seq_len:
            raise KVImportError(  # at least one token left to decode
                f"output limit {max_output_tokens} is not within {num_outputs + 1}.."
                f"{self.config.scheduler.max_seq_len}"
            )

    @torch.inference_mode()
    def write_pages(self, request: Request, payload: KVPayload) -> str | None:
        """Any thread: copy the pages into a RECEIVING request's blocks (no running request reads
        them, and they stay allocated until ``finish_receive``). The error, if the copy failed."""
        first, num_blocks = request.num_shared_blocks, payload.blocks.shape[2]
        try:
            self.kv_cache.import_blocks(
                request.block_ids[first : first + num_blocks], payload.blocks
            )
        except RuntimeError as exc:  # e.g. out of device memory
            return f"KV install failed: {exc}"
        return None

    def finish_receive(
        self, request: Request, state: HandoffState, error: str | None = None
    ) -> None:
        """After ``write_pages``: the request continues decoding (RUNNING) from where the prefill
        side left it, or ends with the write's ``error``. One ended meanwhile (abort, expiry)
        only frees its blocks now."""
        if request.is_finished or error is not None:
            self.blocks.free(request.block_ids)  # _finish leaves them to us while RECEIVING
            if not request.is_finished:
                self.engine.abort(request.request_id, error)
            return
        request.token_ids = list(state.token_ids)
        request.num_computed_tokens = state.num_computed_tokens
        # the prefill side's, for usage; never past the reserved prompt
        request.num_cached_tokens = min(state.num_cached_tokens, request.num_prompt_tokens)
        # its first token was made on the prefill side just before its pages were sent
        request.first_token_time = request.first_token_time or time.monotonic()
        replay_outputs(request)  # every output so far was streamed by the prefill side
        self.engine.cache_computed(request)  # what arrived is reusable by later hand-offs
        self.scheduler.insert_running(request)
