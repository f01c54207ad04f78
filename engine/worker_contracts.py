"""What crosses process boundaries between the coordinator and the worker actors (over Ray).

Every type here is a frozen dataclass that Ray pickles as itself: callers read attributes, never
string keys, and a field added on one side is seen by the other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a front door asks for it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 5  # 1 is served first
    timeout_s: float = 600.0  # the client's own limit for the whole request; 0 = none

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_id(self, request_id: str) -> GenerationRequest:
        """The same request under another id (a retry on another worker pair)."""
        return replace(self, request_id=request_id)
