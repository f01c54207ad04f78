"""The engine: one model, one paged KV cache, one scheduler; driven one step at a time.

Life of a request: ``add_request`` validates and queues it (WAITING) → the scheduler admits it
when its blocks fit (RUNNING) → its prompt is computed in one or more chunks → each step that
reaches its last token samples the next one and emits a :class:`TokenEvent` → it finishes on EOS,
a stop string, its length limit or ``maxSeqLen`` and frees its blocks (FINISHED). ``abort`` ends it
at any point and frees every block. A ``prefill_only`` request instead stops after the first
token and keeps its blocks (HELD) until ``export_kv`` + ``release``; a decode engine continues
it with ``import_kv``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import KVImportError, RequestRejectedError
from engine.kv_cache import KV_LAYOUT, KVCache, bytes_per_block
from engine.kv_transfer import KVLayout, KVPayload, RequestState
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, TokenEvent
from engine.request import FinishReason, Request, RequestStatus
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

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
        self.model = LlamaModel(loaded.hf_config, loaded.weights, self.device, self.dtype)
        self.shape = self.model.shape
        self.eos_token_ids = _eos_ids(loaded)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(
            config.cache.memory_mb * 2**20 // bytes_per_block(self.shape, block_size, self.dtype), 1
        )
        self.kv_cache = KVCache(self.shape, num_blocks, block_size, self.device, self.dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        self.runner = ModelRunner(self.model, self.kv_cache.layers, block_size, self.device)
        self.layout = KVLayout(
            _fingerprint(loaded, self.shape),
            KV_LAYOUT,
            str(self.dtype),
            block_size,
            self.shape.num_layers,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        )
        self.requests: dict[str, Request] = {}
        self._reserved: dict[str, list[int]] = {}
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
    ) -> None:
        """Queue a request; :class:`RequestRejectedError` if it can never run."""
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        num_prompt = len(prompt_token_ids)
        if not 0 < num_prompt <= self.max_prompt_tokens():
            raise RequestRejectedError(
                f"prompt has {num_prompt} tokens; valid range is [1, {self.max_prompt_tokens()}]"
            )
        max_output = (
            1 if prefill_only else min(params.max_new_tokens, self.config.scheduler.max_iter_times)
        )
        request = self._new_request(
            request_id, list(prompt_token_ids), num_prompt, params, max_output, priority
        )
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
        return Request(
            request_id=request_id,
            token_ids=token_ids,
            num_prompt_tokens=num_prompt,
            params=params,
            max_output_tokens=max_output,
            priority=priority,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids[:num_prompt], params.stop),
            arrival_seq=next(self._arrivals),
            generator=make_generator(params.seed, self.device),
        )

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
        for request, num_tokens in scheduled.prefills:
            request.num_computed_tokens += num_tokens
        if samplers:
            now = time.monotonic()
            for request, token_id in zip(samplers, sample(logits, samplers), strict=True):
                events.append(self._append_token(request, token_id, now))
        return events

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
        self.blocks.free(request.block_ids)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _hold(self, request: Request) -> None:
        self.scheduler.remove(request)
        request.status = RequestStatus.HELD

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """End a request wherever it is and free its blocks (and any import reservation)."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:
            self.blocks.free(reserved)
        request = self.requests.get(request_id)
        if request is None:
            return reserved is not None
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
            )
        )
        return True

    # ---- KV export / import ----------------------------------------------------------------

    def export_kv(self, request_id: str) -> KVPayload:
        """The KV pages and state of a HELD prefill-only request (its blocks stay held)."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.HELD:
            raise KeyError(f"request {request_id!r} is not held for export")
        state = RequestState(
            request_id=request_id,
            token_ids=list(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            params=request.params.to_dict(),
            priority=request.priority,
            generator_state=bytes(request.generator.get_state().tolist()),
        )
        return KVPayload(self.layout, state, self.kv_cache.export_blocks(request.block_ids))

    def release(self, request_id: str) -> None:
        """Free a HELD request after its KV was delivered (or given up on)."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.HELD:
            self._finish(request, FinishReason.LENGTH)

    def reserve_import(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Pre-allocate blocks for an incoming hand-off; None when the cache cannot hold it now."""
        needed = self.blocks.blocks_for(num_tokens + 1)
        if request_id in self._reserved or request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        if not self.blocks.can_allocate(needed):
            return None
        self._reserved[request_id] = self.blocks.allocate(needed)
        return self._reserved[request_id]

    @torch.inference_mode()
    def write_reserved(self, payload: KVPayload) -> None:
        """Copy received pages into the blocks reserved for their request.

        Safe on a transport thread while the engine steps: reserved blocks belong to no running
        request. The caller keeps the reservation from being freed meanwhile (``DecodeWorker``
        holds its transfer lock), then calls ``import_kv(..., pages_written=True)``.
        """
        state = payload.state
        block_ids = self._reserved.get(state.request_id)
        if block_ids is None:
            raise KVImportError(f"request {state.request_id!r} has no reservation (aborted?)")
        self.layout.check_compatible(payload.layout)
        num_blocks = self.blocks.blocks_for(state.num_computed_tokens)
        if num_blocks > len(block_ids):
            raise KVImportError(f"{num_blocks} blocks arrived, {len(block_ids)} reserved")
        payload.check_shape(num_blocks)
        self.kv_cache.import_blocks(block_ids[:num_blocks], payload.blocks)

    def import_kv(
        self,
        payload: KVPayload,
        max_output_tokens: int | None = None,
        require_reservation: bool = False,
        pages_written: bool = False,
    ) -> None:
        """Install received pages into a new RUNNING request that continues decoding.

        Uses the blocks of an earlier ``reserve_import`` when there is one; on any failure the
        reservation is freed and the error raised (a mismatch is never decoded into garbage).
        """
        state = payload.state
        max_output_tokens = max_output_tokens or state.max_output_tokens
        block_ids = self._reserved.pop(state.request_id, None)
        if block_ids is None and require_reservation:
            raise KVImportError(f"request {state.request_id!r} has no reservation (aborted?)")
        if block_ids is None:
            if self.reserve_import(state.request_id, state.num_computed_tokens) is None:
                raise KVImportError(f"no free KV blocks for request {state.request_id!r}")
            block_ids = self._reserved.pop(state.request_id)
        try:
            self.layout.check_compatible(payload.layout)
            num_blocks = self.blocks.blocks_for(state.num_computed_tokens)
            if num_blocks > len(block_ids):
                raise KVImportError(f"{num_blocks} blocks arrived, {len(block_ids)} reserved")
            payload.check_shape(num_blocks)
            if not pages_written:
                self.kv_cache.import_blocks(block_ids[:num_blocks], payload.blocks)
            request = self._restore_request(state, max_output_tokens)
        except Exception:
            self.blocks.free(block_ids)
            raise
        request.block_ids = block_ids
        request.status = RequestStatus.RUNNING
        self.requests[state.request_id] = request
        self.scheduler.insert_running(request)

    def _restore_request(self, state: RequestState, max_output_tokens: int) -> Request:
        params = SamplingParams.from_dict(state.params)
        request = self._new_request(
            state.request_id,
            list(state.token_ids),
            state.num_prompt_tokens,
            params,
            max_output_tokens,
            state.priority,
        )
        request.generator.set_state(torch.tensor(list(state.generator_state), dtype=torch.uint8))
        request.detokenizer.append(request.token_ids)  # the first token, streamed by prefill
        request.detokenizer.take_piece(False)
        request.num_computed_tokens = state.num_computed_tokens
        return request

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting
        return EngineStats(
            num_waiting=len(waiting),
            num_running=len(self.scheduler.running),
            num_held=sum(r.status == RequestStatus.HELD for r in self.requests.values()),
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_waiting_prompt_tokens=sum(r.num_uncomputed_tokens for r in waiting),
            num_reserved=len(self._reserved),
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
