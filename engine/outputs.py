"""What the engine reports per step: one event per generated token, plus final events."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.kv_tiers.file_tier import TierStats
from engine.request import FinishReason

# the cause of a request whose output cannot follow its constraint (engine/grammars.py): the
# same on any engine, so a failure with it is final, never migrated
CONSTRAINT_VIOLATED = "constraint_violated"


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log probability, and its most likely alternatives ``(token id, log
    probability)``, best first (the token itself among them when it is one of them)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenEvent:
    """A token a request produced (or, with ``token_id`` None, its end without a new token)."""

    request_id: str
    token_id: int | None
    text: str  # the newly decodable text; "" while a UTF-8 character or stop match is pending
    num_prompt_tokens: int
    num_output_tokens: int
    emitted_at: float  # time.monotonic() when the token was sampled
    finish_reason: FinishReason | None = None
    error: str | None = None
    cause: str = ""  # an ERROR finish's kind, a metric label: worker_lost, handoff_failed, ...
    # prompt tokens whose KV came from the prefix cache instead of being computed (the engine
    # that computed the prompt: the prefill worker's in pd_separate, carried on by the decode's)
    num_cached_tokens: int = 0
    # on the first token of the engine that computed the prompt: how long the request waited
    # there before its prompt's first chunk ran, and from then to this token (the prompt's
    # compute, with whatever else shared those steps)
    queued_s: float | None = None
    prefill_s: float | None = None
    logprobs: TokenLogprobs | None = None  # when its request asked (SamplingParams.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, error: str, cause: str = "engine_error") -> TokenEvent:
        """The last event of a request that failed outside an engine (refused, worker lost)."""
        return cls(request_id, None, "", 0, 0, time.monotonic(), FinishReason.ERROR, error, cause)

    @classmethod
    def aborted(cls, request_id: str) -> TokenEvent:
        """The last event of a request its caller aborted outside an engine."""
        return cls(request_id, None, "", 0, 0, time.monotonic(), FinishReason.ABORT)


@dataclass(frozen=True)
class EngineStats:
    """Load figures the router balances on (all zero: a worker not heard from yet)."""

    num_waiting: int = 0
    num_running: int = 0
    num_held: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    # prompt tokens still to compute: of waiting requests, and of running ones mid-prompt
    num_prompt_tokens_to_compute: int = 0
    num_reserved: int = 0  # incoming hand-offs with blocks set aside (RESERVED or RECEIVING)
    num_cached_blocks: int = 0  # blocks holding reusable prefix KV, in use or free (evictable)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache so far (a counter)
    prefix_cache_hits: int = 0  # of those, tokens found cached (a counter)
    # constrained decoding (engine/grammars.py): compiled grammars kept, compiles so far, and
    # rows masked and seconds spent masking them so far (counters)
    grammar_cache_size: int = 0
    grammar_compiles: int = 0
    grammar_masked_rows: int = 0
    grammar_mask_seconds: float = 0.0
    # speculative decoding (engine/speculation.py), counters: checks made, tokens drafted and
    # accepted, and checks by how many tokens they accepted (index k: k accepted)
    speculative_checks: int = 0
    speculative_drafted: int = 0
    speculative_accepted: int = 0
    speculative_accepted_histogram: tuple[int, ...] = ()
    # KV tiers (engine/kv_tiers): each tier's figures, and blocks queued for them, skipped (the
    # writer too far behind) and served from them (counters)
    kv_tiers: tuple[TierStats, ...] = ()
    kv_tier_demoted: int = 0
    kv_tier_skipped: int = 0
    kv_tier_promoted: int = 0
    prompt_token_seconds: float = 0.0  # the engine's learnt compute time of a prompt token
    # its learnt time of a step without prompt tokens, and those steps' rows (moving averages),
    # and its steps so far (the first ones run cold): what the role planner fits
    decode_step_seconds: float = 0.0
    decode_step_rows: float = 0.0
    num_steps: int = 0
    # prefixes pulled from peers (engine/kv_pull.py), counters: blocks installed here, pulls
    # that installed none, blocks sent to peers
    kv_pulled_blocks: int = 0
    kv_pulls_failed: int = 0
    kv_exported_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / max(self.num_total_blocks, 1)
