"""The request object: the single source of truth about one generation."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the coordinator reads FinishReason here and never loads torch
    import torch

    from engine.detokenizer import IncrementalDetokenizer
    from engine.grammars import GrammarState
    from engine.speculation import DraftState


def _new_generator() -> torch.Generator:
    import torch

    return torch.Generator()


class RequestStatus(enum.IntEnum):
    """Ordered by a request's life: a hand-off's reservation comes before any computing, and
    every status from FINISHED on is final."""

    RESERVED = 0  # decode side: blocks set aside for a hand-off whose KV pages have not arrived
    RECEIVING = 1  # its pages are being written into those blocks, on the transport's thread
    WAITING = 2  # queued (new, or preempted and waiting to recompute)
    RUNNING = 3  # in the running batch, holding blocks
    HELD = 4  # prefill-only request done: blocks kept until its KV is exported and released
    FINISHED = 5


@dataclass(frozen=True)
class NewRequest:
    """What a caller asks an engine to run, whole: ``LLMEngine.add_request`` and
    ``KVImporter.reserve_import`` make their :class:`Request` from it, and nothing patches that
    request afterwards but the engine's own state changes. ``LLMEngine.request`` makes one with
    the output limit of ``engine.token_accounting``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_output_tokens: int  # output limit, first token included (docs/token-accounting.md)
    # generated elsewhere already (a request migrated off a failed worker): computed with the
    # prompt, counted against the limit, and continued after
    output_token_ids: tuple[int, ...] = ()
    priority: int = 5  # 1 is served first
    # whose prompt it is: the prefix cache roots its block hashes here (engine.prefix_hash), so
    # it shares blocks with its own tenant's requests only; "": no tenant
    tenant: str = ""
    client: str = ""  # whose request it is: the waiting queue takes clients in turn
    # a conversation's key (OpenAI's prompt_cache_key): its blocks are kept longer (a session)
    cache_key: str = ""
    arrival_time: float = field(default_factory=time.monotonic)  # its queueing counts from then
    prefill_only: bool = False  # stop after the first token and hold the KV for export

    def __post_init__(self) -> None:
        for name in ("prompt_token_ids", "output_token_ids"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def token_ids(self) -> list[int]:
        """The prompt, then the outputs so far."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def engine_output_limit(self) -> int:
        """The limit the engine decodes this request to: a prefill-only one stops at its next
        token (the rest is the decode side's)."""
        return len(self.output_token_ids) + 1 if self.prefill_only else self.max_output_tokens


class FinishReason(enum.Enum):
    EOS = "eos_token"
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_output_tokens: int  # effective limit: min(max_new_tokens, maxIterTimes), or as imported
    detokenizer: IncrementalDetokenizer
    priority: int = 5  # 1 is served first
    arrival_seq: int = 0  # FCFS order within a priority
    prefill_only: bool = False  # stop after the first token and hold the KV for export
    # whose prompt it is: the prefix cache roots its block hashes here (engine.prefix_hash), so
    # it shares blocks with its own tenant's requests only; "": no tenant
    tenant: str = field(default="", repr=False)
    # whose request it is, for fair queuing within a priority (engine.fair_queue); "": one line
    client: str = field(default="", repr=False)
    cache_key: str = field(default="", repr=False)  # a session's (NewRequest.cache_key)
    queue_round: int | None = field(default=None, repr=False)  # its turn there, kept if preempted
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix caching (engine/block_manager.py): the hashes of its full blocks so far, how many
    # leading blocks are registered in the cache, and how many prompt tokens came from it.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    # Decode side: leading blocks of a reservation it held already (their pages are not sent)
    num_shared_blocks: int = 0
    # re-seeded for every sampled token from the seed and the token's position (engine.sampler)
    generator: torch.Generator = field(default_factory=_new_generator)
    arrival_time: float = field(default_factory=time.monotonic)
    # the start of the first step that computed it: its prompt's first chunk (imported: its
    # first decode here)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    deadline: float | None = None  # RESERVED: ended with an error if its pages are not in by then
    reservation_token: str = field(default="", repr=False)  # RESERVED: pages must carry it
    # a constrained request's matcher (engine/grammars.py), rebuilt by every engine it runs on
    grammar: GrammarState | None = field(default=None, repr=False)
    # speculative decoding (engine/speculation.py): the tokens this step checks after its last
    # one, and how it has been drafting
    draft_token_ids: list[int] = field(default_factory=list, repr=False)
    draft_state: DraftState | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Its prompt is computed and one token is left: a decode row of the next step. A prompt
        chunked with one token left is computed as a one-token row too, but is not one."""
        prompt_computed = self.num_computed_tokens >= self.num_prompt_tokens
        return prompt_computed and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)


def replay_outputs(request: Request) -> None:
    """Run a request's outputs so far through its (new) detokenizer token by token, as their
    own engine did, so its next piece of text follows exactly the text already streamed."""
    detokenizer = request.detokenizer
    for end in range(detokenizer.read_offset + 1, request.num_tokens + 1):
        detokenizer.append(request.token_ids[:end])
        detokenizer.take_piece(False)
