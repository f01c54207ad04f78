"""Continuous batching with chunked prefill, admission by free blocks, and preemption.

Every request has ``token_ids`` and ``num_computed_tokens``; a step computes some of its
uncomputed tokens. A decoding request has exactly one (the token sampled last step); a prompt has
many and is computed in chunks bounded by ``maxPrefillTokens`` per step (fewer while requests
decode, with ``stepTargetMs``, and in a step of prompts alone, with ``prompt_step_target_ms``:
``engine/step_budget.py``). When a step reaches the
end of a request's tokens, the request samples its next token. A preempted request simply drops
its blocks and computed count and goes back to the waiting queue, where it is recomputed.

Order: the running batch is ordered by (priority, arrival): priority 1 first, FCFS within a
priority; the waiting queue by priority, then round-robin across clients within a priority
(``engine/fair_queue.py``), FCFS within a client. Admission needs blocks for the whole
uncomputed sequence, so an admitted prompt never stalls halfway; a running request that cannot
grow preempts the lowest-ordered running request (possibly itself).

Prefix caching: an admitted request first takes the longest cached prefix of its tokens
(always leaving its last token to compute) and needs new blocks only for the rest; cached blocks
nobody uses count as free. A preempted request frees its blocks like a finished one: those it
filled stay cached, so its recompute mostly finds them again. With KV tiers, the blocks a tier
holds after the cached prefix are loaded too (``BlockManager.promote``) and count as cached.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.fair_queue import FairQueue
from engine.request import Request, RequestStatus
from engine.speculation import Speculator
from engine.step_budget import StepBudget


@dataclass
class SchedulerOutput:
    """One-token rows and prompt chunks (request, tokens) for one step. A one-token row is a
    decode row or a prompt's last token; ``num_decode_rows`` counts the decode rows."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    num_decode_rows: int = 0
    num_draft_tokens: int = 0  # drafted tokens the decode rows check (engine/speculation.py)

    def add_one_token_row(self, request: Request) -> None:
        self.decodes.append(request)
        self.num_decode_rows += request.is_decoding

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the step: its chunks' and its one-token rows that end a prompt."""
        return sum(n for _, n in self.prefills) + len(self.decodes) - self.num_decode_rows

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, blocks: BlockManager, speculator: Speculator | None = None
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.speculator = speculator
        self._draft_room = 0  # rows drafts may still add to this step
        self._decode_rows = 0  # ... beside this many decode rows
        self.running: list[Request] = []  # sorted by sort_key
        self._waiting = FairQueue()  # finished ones skipped
        self.num_preemptions = 0
        self.step_budget = StepBudget(
            config.step_target_ms, config.max_prefill_tokens, config.prompt_step_target_ms
        )

    @property
    def waiting(self) -> list[Request]:
        return [r for r in self._waiting if r.status == RequestStatus.WAITING]

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._waiting.push(request)

    def insert_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)

    def remove(self, request: Request) -> None:
        """Take a request out of the running batch (finished, aborted or held) and free nothing."""
        if request in self.running:
            self.running.remove(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # a prompt chunked with one token left is no decode row: counted as one, it would lift a
        # prompt-only step's bound to maxPrefillTokens
        num_decodes = sum(r.is_decoding for r in self.running)
        budget = self.step_budget.tokens(num_decodes)
        if self.speculator is not None:
            self._draft_room = self.speculator.config.max_step_rows - num_decodes
            self._decode_rows = num_decodes
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            budget -= self._schedule_running(request, budget, out)
        self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        request.draft_token_ids = []
        num_tokens = request.num_uncomputed_tokens
        if num_tokens > 1:
            num_tokens = min(num_tokens, budget)
            if num_tokens == 0 or len(out.prefills) >= self.config.max_prefill_batch_size:
                return 0
        if not self._grow(request, request.num_computed_tokens + num_tokens):
            return 0
        if num_tokens == 1:
            out.add_one_token_row(request)
            if self.speculator is not None and self._draft_room > 0:
                self._draft(request, self.speculator, out)
            return 0
        out.prefills.append((request, num_tokens))
        return num_tokens

    def _draft(self, request: Request, speculator: Speculator, out: SchedulerOutput) -> None:
        """Give a decoding request this step's draft, in blocks to spare: a draft never
        preempts anything, nor takes a block another running request may need to grow this
        step; it shrinks to the blocks there are."""
        draft = speculator.draft(request, self._draft_room, self._decode_rows)
        if not draft:
            return
        start = request.num_computed_tokens + 1  # the draft's first position
        needed = self.blocks.blocks_for(start + len(draft)) - len(request.block_ids)
        if needed > 0 and not self.blocks.can_allocate(needed + len(self.running)):
            draft = draft[: len(request.block_ids) * self.blocks.block_size - start]
        elif needed > 0:
            request.block_ids.extend(self.blocks.allocate(needed))
        request.draft_token_ids = draft
        self._draft_room -= len(draft)
        out.num_draft_tokens += len(draft)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Allocate blocks for ``num_tokens``, preempting from the back of the batch if needed."""
        needed = self.blocks.blocks_for(num_tokens) - len(request.block_ids)
        while not self.blocks.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        if needed > 0:
            request.block_ids.extend(self.blocks.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request.block_ids)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        self.num_preemptions += 1
        self.add(request)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        cfg = self.config
        while self._waiting and budget > 0 and len(self.running) < cfg.max_batch_size:
            request = self._waiting.head()
            if request.status != RequestStatus.WAITING:
                self._waiting.pop()
                continue
            if len(out.prefills) >= cfg.max_prefill_batch_size:
                return
            cached = self.blocks.lookup(request.block_hashes, request.token_ids, request.tenant)
            needed = self.blocks.blocks_for(request.num_tokens) - len(cached)
            if not self.blocks.can_take(cached, needed):
                return  # the head of the queue waits for blocks; nothing jumps ahead of it
            self._waiting.pop()
            taken = self.blocks.take(cached)
            taken += self.blocks.promote(
                request.block_hashes, request.token_ids, len(cached), request.tenant
            )  # the blocks a KV tier holds next (engine/kv_tiers), in blocks it needed
            needed -= len(taken) - len(cached)
            self.blocks.count_lookup(request.num_tokens, len(taken))
            request.block_ids = taken + self.blocks.allocate(needed)
            request.num_registered_blocks = len(taken)
            request.num_computed_tokens = len(taken) * self.blocks.block_size
            if request.first_token_time is None:  # what its usage reports
                request.num_cached_tokens = min(
                    request.num_computed_tokens, request.num_prompt_tokens
                )
            self.insert_running(request)
            num_tokens = min(request.num_uncomputed_tokens, budget)
            if request.num_uncomputed_tokens == 1:
                out.add_one_token_row(request)
            else:
                out.prefills.append((request, num_tokens))
                budget -= num_tokens
