"""The engine: one model, one paged KV cache, one scheduler; driven one step at a time.

Life of a request: ``add_request`` validates and queues it (WAITING) → the scheduler admits it
when its blocks fit (RUNNING) → its prompt is computed in one or more chunks → each step that
reaches its last token samples the next one and emits a :class:`TokenEvent` → it finishes on EOS,
a stop string, its length limit or ``maxSeqLen`` and frees its blocks (FINISHED). ``abort`` ends it
at any point and frees every block. A ``prefill_only`` request instead stops after the first
token and keeps its blocks (HELD) until ``export_kv`` + ``release``.

A request may also arrive with output tokens it already generated elsewhere (``output_token_ids``:
a request migrated off a failed worker): they are computed with the prompt, count against its
output limit, and are replayed through its detokenizer, so it continues exactly where it stopped.

A decode engine continues such a request: ``reserve_import`` sets blocks aside for it (RESERVED,
with a deadline); ``take_reservation`` + ``write_pages`` put the arriving pages into them
(RECEIVING; these two alone may run on the transport's thread, see ``_receive_lock``), and
``finish_receive`` starts it decoding (RUNNING). A reservation ends like any request: ``abort``,
or ``expire_reservations`` once its deadline passed. ``import_kv`` does it all in one call.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import KVImportError, RequestRejectedError
from engine.kv_cache import KV_LAYOUT, KVCache, bytes_per_block
from engine.model.gguf_weights import read_quantized
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason, Request, RequestStatus
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.transfer.payload import HandoffState, KVLayout, KVPayload, TransferHeader

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        loaded = loaded or load_model(config.model_path)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.model = LlamaModel(
            loaded.hf_config,
            loaded.weights,
            self.device,
            self.dtype,
            weight_dtype=config.weight_dtype,
            gguf=_gguf_blocks(loaded, config),
        )
        log.info("model %s: %s", loaded.name, self.model.describe())
        self.shape = self.model.shape
        self.eos_token_ids = _eos_ids(loaded)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(
            config.cache.memory_mb * 2**20 // bytes_per_block(self.shape, block_size, self.dtype), 1
        )
        fingerprint = _fingerprint(loaded, self.shape)
        self.kv_cache = KVCache(self.shape, num_blocks, block_size, self.device, self.dtype)
        self.blocks = BlockManager(
            num_blocks,
            block_size,
            enabled=config.cache.enable_prefix_caching,
            root=f"{fingerprint}/{self.dtype}".encode(),
        )
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.runner = ModelRunner(self.model, self.kv_cache.layers, block_size, self.device)
        self.layout = KVLayout(
            fingerprint,
            KV_LAYOUT,
            str(self.dtype),
            block_size,
            self.shape.num_layers,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        )
        self.requests: dict[str, Request] = {}
        # Orders the transport thread's RESERVED -> RECEIVING against this thread ending the
        # request: blocks being written to are freed only once the write is over.
        self._receive_lock = threading.Lock()
        self._import_tokens: dict[str, str] = {}  # reservation secrets, under _receive_lock
        self._pending: list[TokenEvent] = []
        self._arrivals = itertools.count()

    # ---- admission -------------------------------------------------------------------------

    def max_prompt_tokens(self) -> int:
        s = self.config.scheduler
        return min(s.max_input_token_len, s.max_seq_len - 1, self.shape.max_position_embeddings)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 5,
        prefill_only: bool = False,
        output_token_ids: Sequence[int] = (),
        max_output_tokens: int = 0,
    ) -> None:
        """Queue a request; :class:`RequestRejectedError` if it can never run. A request with
        ``output_token_ids`` continues after them (see the module docstring).
        ``max_output_tokens``: its output limit, first token included, when the caller set one
        (a disaggregated request's, docs/token-accounting.md); else min(max_new_tokens,
        maxIterTimes)."""
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        num_prompt = len(prompt_token_ids)
        if not 0 < num_prompt <= self.max_prompt_tokens():
            raise RequestRejectedError(
                f"prompt has {num_prompt} tokens; valid range is [1, {self.max_prompt_tokens()}]"
            )
        max_output = max_output_tokens or min(
            params.max_new_tokens, self.config.scheduler.max_iter_times
        )
        if not prefill_only and len(output_token_ids) >= max_output:
            raise RequestRejectedError(
                f"{len(output_token_ids)} output tokens already generated; the limit is "
                f"{max_output}"
            )
        request = self._new_request(
            request_id, [*prompt_token_ids, *output_token_ids], num_prompt, params, 0, priority
        )
        request.max_output_tokens = len(output_token_ids) + 1 if prefill_only else max_output
        request.prefill_only = prefill_only
        self._check_fits(request)
        self.requests[request_id] = request
        self.scheduler.add(request)

    def _new_request(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt: int,
        params: SamplingParams,
        max_output: int,
        priority: int,
    ) -> Request:
        """A request over ``token_ids`` (the prompt, then any outputs so far, which are replayed
        through the detokenizer as if they had just been generated and streamed)."""
        request = Request(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            params=params,
            max_output_tokens=max_output,
            priority=priority,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids[:num_prompt], params.stop),
            arrival_seq=next(self._arrivals),
            generator=make_generator(self.device),
        )
        _replay_outputs(request)
        return request

    def _check_fits(self, request: Request) -> None:
        longest = min(
            request.num_prompt_tokens + request.max_output_tokens, self.config.scheduler.max_seq_len
        )
        if self.blocks.blocks_for(longest) > self.blocks.num_blocks:
            raise RequestRejectedError(
                f"request needs up to {longest} tokens of KV cache; the cache holds "
                f"{self.blocks.num_blocks * self.blocks.block_size}"
            )

    # ---- stepping --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._pending)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """Run one batched forward over everything scheduled; return the events it produced."""
        events, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return events
        logits, samplers = self.runner.run(scheduled)
        for request in scheduled.decodes:
            request.num_computed_tokens += 1
            self._cache_computed(request)
        for request, num_tokens in scheduled.prefills:
            request.num_computed_tokens += num_tokens
            self._cache_computed(request)
        if samplers:
            now = time.monotonic()
            for request, token_id in zip(samplers, sample(logits, samplers), strict=True):
                events.append(self._append_token(request, token_id, now))
        return events

    def _cache_computed(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed KV in the prefix cache."""
        blocks = self.blocks
        num_full = request.num_computed_tokens // blocks.block_size
        if not blocks.enabled or num_full <= request.num_registered_blocks:
            return
        hashes = blocks.hashes(
            request.block_hashes, request.token_ids, num_full * blocks.block_size
        )
        blocks.register(
            request.block_ids, hashes[:num_full], request.token_ids, request.num_registered_blocks
        )
        request.num_registered_blocks = num_full

    def _append_token(self, request: Request, token_id: int, now: float) -> TokenEvent:
        request.token_ids.append(token_id)
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        stopped = request.detokenizer.append(request.token_ids)
        reason = self._finish_reason(request, token_id, stopped)
        event = TokenEvent(
            request.request_id,
            token_id,
            request.detokenizer.take_piece(reason is not None),
            request.num_prompt_tokens,
            request.num_output_tokens,
            now,
            reason,
            num_cached_tokens=request.num_cached_tokens,
        )
        if reason is not None:
            self._finish(request, reason)
        elif request.prefill_only:
            self._hold(request)
        return event

    def _finish_reason(self, request: Request, token_id: int, stopped: bool) -> FinishReason | None:
        if token_id in self.eos_token_ids and not request.params.ignore_eos:
            return FinishReason.EOS
        if stopped:
            return FinishReason.STOP
        if request.prefill_only:
            return None
        if request.num_output_tokens >= request.max_output_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.scheduler.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        with self._receive_lock:
            receiving, request.status = request.status, RequestStatus.FINISHED
        if receiving != RequestStatus.RECEIVING:  # else finish_receive frees them after the write
            self.blocks.free(request.block_ids)
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _hold(self, request: Request) -> None:
        self.scheduler.remove(request)
        request.status = RequestStatus.HELD

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """End a request wherever it is (a reservation too) and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        reason = FinishReason.ERROR if error else FinishReason.ABORT
        self._finish(request, reason)
        self._pending.append(
            TokenEvent(
                request_id,
                None,
                request.detokenizer.take_piece(True),
                request.num_prompt_tokens,
                request.num_output_tokens,
                time.monotonic(),
                reason,
                error,
                num_cached_tokens=request.num_cached_tokens,
            )
        )
        return True

    # ---- KV hand-off: the prefill side ------------------------------------------------------

    def export_kv(
        self, request_id: str, max_output_tokens: int = 0, first_block: int = 0
    ) -> KVPayload:
        """The KV pages and state of a HELD prefill-only request (its blocks stay held);
        ``max_output_tokens`` is the decode side's output limit, first token included. Pages
        start at ``first_block``: the decode side holds the blocks before it already."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.HELD:
            raise KeyError(f"request {request_id!r} is not held for export")
        if not 0 <= first_block < len(request.block_ids):
            raise ValueError(
                f"first_block must be in [0, {len(request.block_ids) - 1}], got {first_block}"
            )
        state = HandoffState(
            request_id=request_id,
            token_ids=list(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            params=request.params,
            priority=request.priority,
            max_output_tokens=max_output_tokens,
            first_block=first_block,
            num_cached_tokens=request.num_cached_tokens,
        )
        pages = self.kv_cache.export_blocks(request.block_ids[first_block:])
        return KVPayload(self.layout, state, pages)

    def release(self, request_id: str) -> None:
        """Free a HELD request after its KV was delivered (or given up on)."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.HELD:
            self._finish(request, FinishReason.LENGTH)

    # ---- KV hand-off: the decode side ------------------------------------------------------

    def reserve_import(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        priority: int = 5,
        timeout_s: float | None = None,
        output_token_ids: Sequence[int] = (),
        token: str = "",
    ) -> Request | None:
        """Set blocks aside for an incoming hand-off: a RESERVED request that ends with an error
        if its pages are not in within ``timeout_s``. None when the cache cannot hold it now.
        ``output_token_ids``: the outputs a migrated request arrives with, besides its prompt.
        ``token``: the reservation's secret; only pages carrying it are taken.

        Leading blocks of the request found in the prefix cache are shared, not reserved anew:
        ``num_shared_blocks`` of the returned request; the pages that come start after them."""
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        token_ids = [*prompt_token_ids, *output_token_ids]
        hashes: list[bytes] = []
        shared = self.blocks.lookup(hashes, token_ids)
        num_new = self.blocks.blocks_for(len(token_ids) + 1) - len(shared)
        if not self.blocks.can_take(shared, num_new):
            return None
        self.blocks.count_lookup(len(token_ids), len(shared))
        # Its first token and output limit come with the pages (finish_receive).
        num_prompt = len(prompt_token_ids)
        request = self._new_request(
            request_id, token_ids[:num_prompt], num_prompt, params, 0, priority
        )
        request.token_ids = token_ids  # its outputs are replayed when their pages are in
        request.status = RequestStatus.RESERVED
        request.block_hashes = hashes
        request.block_ids = self.blocks.take(shared) + self.blocks.allocate(num_new)
        request.num_shared_blocks = request.num_registered_blocks = len(shared)
        if timeout_s is not None:
            request.deadline = request.arrival_time + timeout_s
        self.requests[request_id] = request
        with self._receive_lock:
            for ended in [r for r in self._import_tokens if r not in self.requests]:
                del self._import_tokens[ended]
            self._import_tokens[request_id] = token
        return request

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
                self.abort(request.request_id, f"KV pages did not arrive within {waited:.0f} s")

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole KV cache: more pages than that never arrive for one request."""
        block_bytes = bytes_per_block(self.shape, self.layout.block_size, self.dtype)
        return self.blocks.num_blocks * block_bytes

    def check_transfer_header(self, header: TransferHeader) -> None:
        """Any thread: the handshake, before any page is read. Raises :class:`KVImportError`
        unless a live reservation with the header's secret awaits pages of this layout and
        shape."""
        with self._receive_lock:
            request = self._live_reservation(header.request_id, header.token)
            self.layout.check_compatible(header.layout)
            self._check_page_shape(request, header.shape)

    def take_reservation(self, payload: KVPayload, max_output_tokens: int | None = None) -> Request:
        """Any thread: check arriving pages against their reservation and mark it RECEIVING.

        Raises :class:`KVImportError` (the request keeps its reservation) for pages that have no
        live reservation with their secret or do not fit it: another model or layout, more
        blocks, another shape, or a request state at odds with the reservation (another prompt,
        token ids out of the vocabulary, counts that do not add up). ``max_output_tokens``
        overrides the state's output limit.
        """
        state = payload.state
        with self._receive_lock:
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
            self._check_state(request, state, max_output_tokens or state.max_output_tokens)
            request.status = RequestStatus.RECEIVING
            self._import_tokens.pop(state.request_id, None)
        return request

    def _live_reservation(self, request_id: str, token: str) -> Request:
        """Under ``_receive_lock``: the RESERVED request whose secret is ``token``. Every miss
        gets the same answer, whatever was wrong."""
        request = self.requests.get(request_id)
        expected = self._import_tokens.get(request_id, "")
        matches = hmac.compare_digest(token.encode(), expected.encode())
        if not matches or request is None or request.status != RequestStatus.RESERVED:
            raise KVImportError("no reservation for these pages (aborted?)")
        return request

    def _check_page_shape(self, request: Request, shape: tuple[int, ...]) -> None:
        layout = self.layout
        num_blocks = shape[2] if len(shape) == 6 else 0
        expected = (
            layout.num_layers,
            2,
            num_blocks,
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        if shape != expected:
            raise KVImportError(f"KV blocks have shape {shape}, expected {expected}")
        reserved = len(request.block_ids) - request.num_shared_blocks
        if num_blocks > reserved:
            raise KVImportError(f"{num_blocks} blocks arrived, {reserved} reserved")

    def _check_state(self, request: Request, state: HandoffState, max_output_tokens: int) -> None:
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
        num_outputs = len(tokens) - num_prompt
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
        self,
        request: Request,
        state: HandoffState,
        error: str | None = None,
        max_output_tokens: int | None = None,
    ) -> None:
        """After ``write_pages``: the request continues decoding (RUNNING) from where the prefill
        side left it, or ends with the write's ``error``. One ended meanwhile (abort, expiry)
        only frees its blocks now."""
        if request.is_finished or error is not None:
            self.blocks.free(request.block_ids)  # _finish leaves them to us while RECEIVING
            if not request.is_finished:
                self.abort(request.request_id, error)
            return
        request.token_ids = list(state.token_ids)
        request.num_computed_tokens = state.num_computed_tokens
        request.num_cached_tokens = state.num_cached_tokens  # the prefill side's, for usage
        request.max_output_tokens = max_output_tokens or state.max_output_tokens
        _replay_outputs(request)  # every output so far was streamed by the prefill side
        self._cache_computed(request)  # what arrived is reusable by later hand-offs
        self.scheduler.insert_running(request)

    def import_kv(self, payload: KVPayload, max_output_tokens: int | None = None) -> None:
        """Install received pages into a request that continues decoding: into its reservation,
        or into blocks reserved now. On a mismatch the reservation ends with the error, which is
        raised too (pages are never decoded into garbage)."""
        state = payload.state
        if state.request_id not in self.requests:
            reserved = self.reserve_import(
                state.request_id,
                state.prompt_token_ids,
                state.params,
                state.priority,
                output_token_ids=state.token_ids[state.num_prompt_tokens :],
                token=payload.token,
            )
            if reserved is None:
                raise KVImportError(f"no free KV blocks for request {state.request_id!r}")
        try:
            request = self.take_reservation(payload, max_output_tokens)
        except KVImportError as exc:
            if self.requests[state.request_id].status == RequestStatus.RESERVED:
                self.abort(state.request_id, str(exc))
            raise
        error = self.write_pages(request, payload)
        self.finish_receive(request, state, error, max_output_tokens)
        if error is not None:
            raise KVImportError(error)

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting
        statuses = Counter(r.status for r in self.requests.values())
        return EngineStats(
            num_waiting=len(waiting),
            num_running=len(self.scheduler.running),
            num_held=statuses[RequestStatus.HELD],
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_waiting_prompt_tokens=sum(r.num_uncomputed_tokens for r in waiting),
            num_reserved=statuses[RequestStatus.RESERVED] + statuses[RequestStatus.RECEIVING],
            num_cached_blocks=self.blocks.num_cached_blocks,
            prefix_cache_queries=self.blocks.num_queried_tokens,
            prefix_cache_hits=self.blocks.num_hit_tokens,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks, the demo); returns output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        while any(i in self.requests for i in ids):
            for event in self.step():
                if event.request_id in outputs and event.token_id is not None:
                    outputs[event.request_id].append(event.token_id)
        return [outputs[i] for i in ids]


def _replay_outputs(request: Request) -> None:
    """Run a request's outputs so far through its (new) detokenizer token by token, as their
    own engine did, so its next piece of text follows exactly the text already streamed."""
    detokenizer = request.detokenizer
    for end in range(detokenizer.read_offset + 1, request.num_tokens + 1):
        detokenizer.append(request.token_ids[:end])
        detokenizer.take_piece(False)


def _gguf_blocks(loaded: LoadedModel, config: EngineConfig) -> dict | None:
    """The GGUF's own quantized matrices when ``weight_dtype`` ``auto`` may compute with them."""
    if config.weight_dtype != "auto" or loaded.gguf_path is None:
        return None
    if config.torch_device.type != "cpu" or config.torch_dtype != torch.float32:
        return None
    return read_quantized(loaded.gguf_path, loaded.hf_config)


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    eos: Any = getattr(loaded.hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)


def _fingerprint(loaded: LoadedModel, shape: Any) -> str:
    """Identifies the weights cheaply: the shape plus a hash of the first embedding rows."""
    sample_rows = loaded.weights["model.embed_tokens.weight"][:8].float().contiguous()
    digest = hashlib.sha256(repr(shape).encode() + sample_rows.numpy().tobytes())
    return digest.hexdigest()[:16]
