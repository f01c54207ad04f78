"""What crosses process boundaries between the coordinator and the worker actors (over Ray).

Every type here is a frozen dataclass that Ray pickles as itself: callers read attributes, never
string keys, and a field added on one side is seen by the other.

    coordinator ──GenerationRequest──► DecodeWorker.reserve ──► Reservation
    coordinator ──GenerationRequest + HandoffTarget──► PrefillWorker.prefill
                                       ──► TokenEvent ..., HandoffResult
    coordinator ──GenerationRequest──► ColocatedWorker.generate ──► TokenEvent ...
    coordinator ──► WorkerRuntime.load ──► WorkerLoad
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a front door asks for it."""

    request_id: str
    prompt_token_ids: Sequence[int]  # stored as a tuple
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


@dataclass(frozen=True)
class HandoffTarget:
    """Where a prefill worker pushes a request's KV, and how far the decode worker takes it."""

    endpoint: str  # the decode worker's KV endpoint, from its Reservation
    max_output_tokens: int  # output limit, first token included (docs/token-accounting.md)


@dataclass(frozen=True)
class Reservation:
    """A decode worker's answer to ``reserve``: blocks set aside and the endpoint to push the
    pages to, or the reason it refused."""

    granted: bool
    endpoint: str = ""
    reason: str = ""

    @classmethod
    def refused(cls, reason: str) -> Reservation:
        return cls(False, reason=reason)


@dataclass(frozen=True)
class HandoffResult:
    """The prefill side's last word on a request: its KV reached the decode worker, or not."""

    request_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's engine figures, as the router and ``/v1/instances`` see them."""

    role: str
    instance: int
    pid: int
    stats: EngineStats

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON: role, instance, every EngineStats figure, pid."""
        return {"role": self.role, "instance": self.instance, **asdict(self.stats), "pid": self.pid}
