"""What the engine reports per step: one event per generated token, plus final events."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import FinishReason


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """Load figures the router balances on."""

    num_waiting: int
    num_running: int
    num_held: int
    num_free_blocks: int
    num_total_blocks: int
    num_waiting_prompt_tokens: int
    num_reserved: int = 0  # incoming hand-offs with blocks set aside

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks
