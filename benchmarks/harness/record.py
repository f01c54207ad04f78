"""The one record of a request every load generator writes: when it was sent, its first token,
its gaps, how it ended (the server's finish reason, or the error that ended it) and what the
server's usage said of its prompt (for prefix-cache hit rates)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.harness.stats import percentile as _percentile


@dataclass
class RequestRecord:
    """What one request did, as the load generator saw it. It succeeded only when it ended
    without an error, with a token, and (where the protocol says how it ended) a finish reason:
    a stream that stops without one is a failure, never a normal finish."""

    prompt_tokens: int
    target_output_tokens: int
    sent_at: float = 0.0  # seconds since the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token arrivals
    error: str | None = None
    finish_reason: str | None = None
    served_prompt_tokens: int | None = None  # the usage's prompt_tokens
    # the usage's prompt_tokens_details.cached_tokens (llama.cpp: its timings' cache_n); None:
    # the server did not say
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.output_tokens > 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def p99_gap_s(self) -> float | None:
        return percentile(self.gaps_s, 99) if self.ok else None

    def meets(self, ttft_s: float, tpot_s: float, itl_s: float | None = None) -> bool:
        tpot, gap = self.tpot_s, self.p99_gap_s
        return (
            self.ok
            and self.ttft_s <= ttft_s
            and (tpot is None or tpot <= tpot_s)
            and (not itl_s or gap is None or gap <= itl_s)
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile by the harness's one rule (:func:`benchmarks.harness.stats.
    percentile`); None for no values (a run whose requests all failed has no latencies)."""
    return _percentile(values, q) if values else None
