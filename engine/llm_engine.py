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

A decode engine continues a request from the pages a prefill engine exported
(``engine/kv_import.py``: RESERVED, RECEIVING, then RUNNING like any other).

Prefix caching (``engine/block_manager.py``): every block full of computed KV is registered in
the cache as soon as it is; an admitted request starts after the longest cached prefix of its
tokens, and a finished one leaves its blocks cached for later requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestRejectedError
from engine.grammars import GrammarCache, PendingMasks
from engine.kernels import set_activation_dtype
from engine.kernels.isa import resolved_prompt_matmul_dtype
from engine.kv_cache import KV_LAYOUT, KVCache, bytes_per_block
from engine.kv_import import KVImporter
from engine.kv_pull import PrefixPulls
from engine.kv_tiers.engine_tiers import tiers_for
from engine.model.gguf_weights import read_quantized
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.outputs import CONSTRAINT_VIOLATED, EngineStats, TokenEvent, TokenLogprobs
from engine.request import FinishReason, NewRequest, Request, RequestStatus, replay_outputs
from engine.sampler import sample, start_masks, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculation import Speculator
from engine.token_accounting import output_limit
from engine.transfer.payload import HandoffState, KVLayout, KVPayload

log = logging.getLogger(__name__)
CHECKPOINT_BLOCKS = 256  # cached blocks an idle engine queues for the disk tier at a time


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.kv_dtype = config.torch_kv_dtype
        loaded = loaded or load_model(config.model_path)
        self.activation_dtype = set_activation_dtype(config.activation_dtype)
        self.prompt_matmul_dtype = resolved_prompt_matmul_dtype(
            config.prompt_matmul_dtype, self.device
        )
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.model = LlamaModel(
            loaded.hf_config,
            loaded.weights,
            self.device,
            self.dtype,
            weight_dtype=config.weight_dtype,
            gguf=_gguf_blocks(loaded, config),
            prompt_matmul_dtype=self.prompt_matmul_dtype,
        )
        log.info(
            "model %s: %s, decode rows on %s activations",
            loaded.name,
            self.model.describe(),
            self.activation_dtype,
        )
        self.shape = self.model.shape
        self.eos_token_ids = _eos_ids(loaded)
        # constrained requests' compiled grammars (engine/grammars.py)
        self.grammars = GrammarCache(self.tokenizer, self.shape.vocab_size, self.eos_token_ids)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or _blocks_in(config, self.shape, self.kv_dtype)
        fingerprint = _fingerprint(loaded, self.shape)
        self.kv_cache = KVCache(self.shape, num_blocks, block_size, self.device, self.kv_dtype)
        self.blocks = BlockManager(
            num_blocks,
            block_size,
            enabled=config.cache.enable_prefix_caching,
            root=f"{fingerprint}/{self.dtype}/{self.kv_dtype}".encode(),
        )
        self.speculator = self._speculator(config)
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.speculator)
        self.runner = ModelRunner(self.model, self.kv_cache.layers, block_size, self.device)
        self.layout = _kv_layout(fingerprint, self.shape, str(self.kv_dtype), block_size)
        self.session_ttl_s = config.cache.session_ttl_s  # prompt_cache_key: blocks kept longer
        self.tiers = tiers_for(config.cache, self.layout, self.kv_cache)  # engine/kv_tiers
        if self.tiers is not None:
            self.blocks.on_evict, self.blocks.tiers = self.tiers.demote, self.tiers
            self.tiers.events = self.blocks.events
            self.tiers.keep = self.blocks.is_preferred
        self.requests: dict[str, Request] = {}
        self.importer = KVImporter(self)  # hand-offs received (engine/kv_import.py)
        self.pulls = PrefixPulls(self)  # prefixes pulled from peers (engine/kv_pull.py)
        self._pending: list[TokenEvent] = []
        self._arrivals = itertools.count()

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        """Speculative decoding where configured, on a batch-invariant model (it needs the fused
        native decode layers: none on CUDA, or without a compiler)."""
        wanted = config.batch_invariant or config.speculative.enabled
        invariant = self.model.set_batch_invariant(wanted)
        if wanted and not invariant:
            log.warning(
                "batch invariance needs the fused native decode layers, which this model does "
                "not run on; %s",
                "speculative decoding is off" if config.speculative.enabled else "it is off",
            )
        if not (invariant and config.speculative.enabled):
            return None
        return Speculator(config.speculative, config.scheduler.max_seq_len)

    # ---- admission -------------------------------------------------------------------------

    def max_prompt_tokens(self) -> int:
        return self.config.scheduler.max_prompt_tokens(self.shape.max_position_embeddings)

    def request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        disaggregated: bool = False,
        **fields: Any,
    ) -> NewRequest:
        """A :class:`NewRequest` whose output limit is the colocated (or ``disaggregated``) one
        of this engine's ``maxIterTimes`` (``engine.token_accounting``), unless ``fields`` set
        ``max_output_tokens``; ``fields``: the rest of its fields."""
        max_iter_times = self.config.scheduler.max_iter_times
        limit = output_limit(params.max_new_tokens, max_iter_times, disaggregated)
        fields.setdefault("max_output_tokens", limit)
        return NewRequest(request_id, tuple(prompt_token_ids), params, **fields)

    def add_request(self, new: NewRequest) -> None:
        """Queue a request; :class:`RequestRejectedError` if it can never run. One with output
        tokens so far continues after them (see the module docstring)."""
        if new.request_id in self.requests:
            raise RequestRejectedError(f"request id {new.request_id!r} is already in use")
        num_prompt = len(new.prompt_token_ids)
        if not 0 < num_prompt <= self.max_prompt_tokens():
            raise RequestRejectedError(
                f"prompt has {num_prompt} tokens; valid range is [1, {self.max_prompt_tokens()}]"
            )
        num_outputs = len(new.output_token_ids)
        if not new.prefill_only and num_outputs >= new.max_output_tokens:
            raise RequestRejectedError(
                f"{num_outputs} output tokens already generated; the limit is "
                f"{new.max_output_tokens}"
            )
        request = self.new_request(new)
        self._check_fits(request)
        self.requests[new.request_id] = request
        self.scheduler.add(request)

    def new_request(self, new: NewRequest, replay: bool = True, **state: Any) -> Request:
        """The engine's request for ``new`` over its prompt and outputs so far, which (with
        ``replay``) go through the detokenizer as if they had just been generated and streamed,
        and through its grammar's matcher before its next token; ``state``: the engine's own
        fields set from the start (a reservation's). A constraint that does not compile is
        :class:`~engine.errors.GrammarError`."""
        params, prompt = new.params, list(new.prompt_token_ids)
        request = Request(
            request_id=new.request_id,
            token_ids=new.token_ids,
            num_prompt_tokens=len(new.prompt_token_ids),
            params=params,
            max_output_tokens=new.engine_output_limit,
            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.stop),
            priority=new.priority,
            arrival_seq=next(self._arrivals),
            prefill_only=new.prefill_only,
            tenant=new.tenant,
            client=new.client,
            cache_key=new.cache_key,
            arrival_time=new.arrival_time,
            generator=torch.Generator(device=self.device),
            grammar=self.grammars.state(params.constraint),
            **state,
        )
        if replay:
            replay_outputs(request)
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
        scheduling = time.monotonic()  # drafts are made there: their cost is the step's too
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return events
        start = time.monotonic()
        masks: list[PendingMasks | None] = []

        def start_masking(samplers: list[Request]) -> None:  # computed while the forward runs
            masks.append(start_masks(_undrafted(samplers), self.grammars))

        logits, samplers = self.runner.run(scheduled, start_masking)
        # a one-token prompt is computed as a decode
        computed = [*((r, 1) for r in scheduled.decodes), *scheduled.prefills]
        for request, num_tokens in computed:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
            request.num_computed_tokens += num_tokens
            self.cache_computed(request)
        if samplers:
            now = time.monotonic()
            started = masks[0] if masks else None
            rows = [i for i, r in enumerate(samplers) if not r.draft_token_ids]
            plain = [samplers[i] for i in rows]
            if plain:
                plain_logits = logits if len(plain) == len(samplers) else logits[rows]
                chosen = sample(plain_logits, plain, self.grammars, started)
                logprobs = token_logprobs(plain_logits, plain, chosen, self.model.native)
                tokens = zip(plain, chosen, logprobs, strict=True)
                events += [self._append_token(r, token, now, lp) for r, token, lp in tokens]
            if len(plain) < len(samplers):
                events += self._check_drafts(logits, samplers, now)
        seconds = time.monotonic() - start  # sampling waited for the device
        budget = self.scheduler.step_budget
        rows_computed = scheduled.num_decode_rows + scheduled.num_draft_tokens
        budget.observe(rows_computed, scheduled.num_prompt_tokens, seconds)
        if self.speculator is not None and not scheduled.num_prompt_tokens and rows_computed:
            self.speculator.observe_step(rows_computed, time.monotonic() - scheduling)
        return events

    def _check_drafts(
        self, logits: torch.Tensor, samplers: list[Request], now: float
    ) -> list[TokenEvent]:
        """Sample the rows of each drafted request in turn (``engine/speculation.py``): its
        tokens while they equal its draft, then the first that differs (or ends it); a
        constrained row is masked as its grammar stands after the tokens before it."""
        events: list[TokenEvent] = []
        row = 0
        while row < len(samplers):
            request = samplers[row]
            draft = request.draft_token_ids
            if not draft:
                row += 1
                continue
            accepted = 0
            for j in range(len(draft) + 1):
                scores = logits[row + j : row + j + 1]
                token = sample(scores, [request], self.grammars)[0]
                logprobs = token_logprobs(scores, [request], [token], self.model.native)[0]
                events.append(self._append_token(request, token, now, logprobs))
                if request.is_finished or j == len(draft) or token != draft[j]:
                    break
                request.num_computed_tokens += 1  # row j + 1 computed this very token
                self.cache_computed(request)  # before a later token may finish it
                accepted += 1
            row += len(draft) + 1
            assert self.speculator is not None
            self.speculator.record(request, len(draft), accepted)
            request.draft_token_ids = []
            if not request.is_finished:
                self._drop_unused_blocks(request)
        return events

    def _drop_unused_blocks(self, request: Request) -> None:
        """Free the blocks a request took for draft tokens it did not keep."""
        keep = self.blocks.blocks_for(request.num_tokens)
        if len(request.block_ids) > keep:
            unused = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.blocks.free(unused)

    def cache_computed(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed KV in the prefix cache."""
        blocks = self.blocks
        num_full = request.num_computed_tokens // blocks.block_size
        if not blocks.enabled or num_full <= request.num_registered_blocks:
            return
        hashes = blocks.extend_hashes(
            request.block_hashes, request.token_ids, num_full * blocks.block_size, request.tenant
        )
        blocks.register(
            request.block_ids,
            hashes[:num_full],
            request.token_ids,
            request.num_registered_blocks,
            request.tenant,
        )
        request.num_registered_blocks = num_full

    def _append_token(
        self, request: Request, token_id: int, now: float, logprobs: TokenLogprobs | None = None
    ) -> TokenEvent:
        queued_s = prefill_s = None
        if request.first_token_time is None and request.first_scheduled_time is not None:
            queued_s = request.first_scheduled_time - request.arrival_time
            prefill_s = now - request.first_scheduled_time
        request.token_ids.append(token_id)
        request.first_token_time = request.first_token_time or now
        grammar = request.grammar
        if grammar is not None and not grammar.catch_up(request.output_token_ids):
            return self._fail(request, grammar.error or "constraint violated", now)
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
            queued_s=queued_s,
            prefill_s=prefill_s,
            logprobs=logprobs,
        )
        if reason is not None:
            self._finish(request, reason)
        elif request.prefill_only:
            self._hold(request)
        return event

    def _finish_reason(self, request: Request, token_id: int, stopped: bool) -> FinishReason | None:
        if token_id in self.eos_token_ids and not request.params.ignore_eos:
            return FinishReason.EOS
        if stopped or (request.grammar is not None and request.grammar.completed):
            return FinishReason.STOP
        if request.prefill_only:
            return None
        at_limit = request.num_output_tokens >= request.max_output_tokens
        if at_limit or request.num_tokens >= self.config.scheduler.max_seq_len:
            return FinishReason.LENGTH
        return None

    def _fail(self, request: Request, error: str, now: float) -> TokenEvent:
        """End ``request`` with an error, its last token unsent (the event carries no text)."""
        self._finish(request, FinishReason.ERROR)
        return TokenEvent(
            request.request_id,
            None,
            "",
            request.num_prompt_tokens,
            request.num_output_tokens - 1,
            now,
            FinishReason.ERROR,
            error,
            cause=CONSTRAINT_VIOLATED,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        with self.importer.receive_lock:
            receiving, request.status = request.status, RequestStatus.FINISHED
        if receiving != RequestStatus.RECEIVING:  # else finish_receive frees them after the write
            if request.cache_key and self.session_ttl_s:  # a session's: kept longer
                self.blocks.prefer(request.block_ids, time.monotonic() + self.session_ttl_s)
            self.blocks.free(request.block_ids)
        request.finish_reason = reason
        del self.requests[request.request_id]

    def _hold(self, request: Request) -> None:
        self.scheduler.remove(request)
        request.status = RequestStatus.HELD

    def abort(self, request_id: str, error: str | None = None, cause: str = "") -> bool:
        """End a request wherever it is (a reservation too) and free its blocks; with ``error``
        it ends as failed, its event naming ``cause``."""
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
                cause,
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

    # ---- introspection ---------------------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole KV cache: more pages than that never arrive for one request."""
        block_bytes = bytes_per_block(self.shape, self.layout.block_size, self.kv_dtype)
        return self.blocks.num_blocks * block_bytes

    def stats(self) -> EngineStats:
        waiting = self.scheduler.waiting
        statuses = Counter(r.status for r in self.requests.values())
        return EngineStats(
            num_waiting=len(waiting),
            num_running=len(self.scheduler.running),
            num_held=statuses[RequestStatus.HELD],
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.blocks.num_blocks,
            num_prompt_tokens_to_compute=_prompt_tokens_to_compute(waiting, self.scheduler.running),
            num_reserved=statuses[RequestStatus.RESERVED] + statuses[RequestStatus.RECEIVING],
            num_cached_blocks=self.blocks.num_cached_blocks,
            prefix_cache_queries=self.blocks.num_queried_tokens,
            prefix_cache_hits=self.blocks.num_hit_tokens,
            grammar_cache_size=len(self.grammars),
            grammar_compiles=self.grammars.stats.compiles,
            grammar_masked_rows=self.grammars.stats.masked_rows,
            grammar_mask_seconds=self.grammars.stats.mask_seconds,
            prompt_token_seconds=self.scheduler.step_budget.token_s,
            decode_step_seconds=self.scheduler.step_budget.decode_s,
            decode_step_rows=self.scheduler.step_budget.decode_rows,
            num_steps=self.scheduler.step_budget.num_steps,
            kv_pulled_blocks=self.pulls.stats.pulled_blocks,
            kv_pulls_failed=self.pulls.stats.failed,
            kv_exported_blocks=self.pulls.stats.exported_blocks,
            **self._speculation_stats(),
            **self._tier_stats(),
        )

    def checkpoint_tiers(self, limit: int = CHECKPOINT_BLOCKS) -> int:
        """Queue up to ``limit`` cached blocks for the tiers that lack them (engine/kv_tiers/
        tiers.py): every block to the node-shared tier, the reused ones to disk. The engine loop
        calls it while idle, so a restarted worker finds what this one computed. Returns how
        many blocks it queued."""
        tiers = self.tiers
        if tiers is None:
            return 0
        queued = 0
        for due, to_host, to_disk in (
            (tiers.take_due(limit), False, True),
            (tiers.take_due_host(limit), True, False),
        ):
            cached = (self.blocks.cached_block(h) for h in due)
            chosen = [b for b in cached if b is not None and not (to_disk and tiers.on_disk(b[1]))]
            tiers.checkpoint(chosen, to_host, to_disk)
            queued += len(chosen)
        return queued

    def _tier_stats(self) -> dict[str, Any]:
        if self.tiers is None:
            return {}
        return {
            "kv_tiers": tuple(dataclasses.replace(s) for s in self.tiers.stats()),
            "kv_tier_demoted": self.tiers.demoted,
            "kv_tier_skipped": self.tiers.skipped,
            "kv_tier_promoted": self.blocks.num_promoted_blocks,
        }

    def _speculation_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        histogram = stats.accepted_histogram
        return {
            "speculative_checks": stats.checks,
            "speculative_drafted": stats.drafted,
            "speculative_accepted": stats.accepted,
            "speculative_accepted_histogram": tuple(
                histogram[k] for k in range(self.speculator.config.max_draft + 1)
            ),
        }

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks, the demo); returns output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(self.request(request_id, prompt, p))
        while any(i in self.requests for i in ids):
            for event in self.step():
                if event.request_id in outputs and event.token_id is not None:
                    outputs[event.request_id].append(event.token_id)
        return [outputs[i] for i in ids]


def _undrafted(requests: list[Request]) -> list[Request]:
    """The requests whose rows sample as one batch: those without a draft this step."""
    return [r for r in requests if not r.draft_token_ids]


def _prompt_tokens_to_compute(waiting: Sequence[Request], running: Sequence[Request]) -> int:
    """Prompt tokens not computed yet: all of a waiting request's, and what a running one has
    left of its prompt (a decoding request's one token to compute is its newest, not a prompt's)."""
    left = sum(r.num_uncomputed_tokens for r in waiting)
    return left + sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in running)


def _gguf_blocks(loaded: LoadedModel, config: EngineConfig) -> dict | None:
    """The GGUF's own quantized matrices when ``weight_dtype`` ``auto`` may compute with them."""
    if config.weight_dtype != "auto" or loaded.gguf_path is None:
        return None
    if config.torch_device.type != "cpu" or config.torch_dtype != torch.float32:
        return None
    return read_quantized(loaded.gguf_path, loaded.hf_config)


def _blocks_in(config: EngineConfig, shape: Any, dtype: torch.dtype) -> int:
    """KV blocks in ``kvCacheMemoryMB`` (at least one)."""
    block_bytes = bytes_per_block(shape, config.cache.block_size, dtype)
    return max(config.cache.memory_mb * 2**20 // block_bytes, 1)


def _kv_layout(fingerprint: str, shape: Any, dtype: str, block_size: int) -> KVLayout:
    """What a KV page of this engine is, as a hand-off's header says it."""
    return KVLayout(
        fingerprint, KV_LAYOUT, dtype, block_size,
        shape.num_layers, shape.num_kv_heads, shape.head_dim,
    )  # fmt: skip


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    eos: Any = getattr(loaded.hf_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)


def _fingerprint(loaded: LoadedModel, shape: Any) -> str:
    """Identifies the weights cheaply: the shape plus a hash of the first embedding rows."""
    digest = hashlib.sha256(repr(shape).encode() + loaded.embedding_sample.numpy().tobytes())
    return digest.hexdigest()[:16]
