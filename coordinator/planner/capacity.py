"""What a split of workers between the two roles would give: TTFT and ITL predicted from the
traffic's rates and each role's step times, fitted from the workers' own measurements.

- **Prefill**: a prompt token costs ``token_s`` (a moving average of the warm prefill workers'
  learnt figure, ``EngineStats.prompt_token_seconds``). With ``P`` workers and prompt tokens
  arriving at ``R`` per second, a worker is busy ``ρ = R·token_s / P`` of the time; a prompt of
  ``n`` tokens waits for the backlog already queued (``queued·token_s / P``) and, as in an
  M/D/1 queue, ``S·ρ / 2(1 − ρ)`` more, ``S = n·token_s`` its own compute: TTFT ≈ backlog + S +
  that wait (infinite at ``ρ ≥ 1``).
- **Decode**: a step of ``b`` rows takes ``c + d·b`` (a least-squares fit, recent samples
  weighing more, over the warm decode workers' ``(rows, step seconds)``). A request stays
  ``L·ITL`` seconds for its ``L`` outputs, so ``D`` workers hold ``b = a·ITL / D`` rows each at an
  output rate of ``a`` tokens per second (Little's law), and ``ITL = c + d·b`` solves to
  ``ITL = c / (1 − d·a / D)`` (infinite when ``d·a / D ≥ 1``).

A worker's first steps after a start or a role switch run slow (kernels, caches, allocator); the
planner feeds only warm workers' figures here, so they never look like a lasting slowdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.decayed_line import DecayedLine

PRIOR_TOKEN_S = 0.001  # a prompt token, until a warm prefill worker reported
PRIOR_STEP = (0.02, 0.002)  # a decode step's (fixed, per row) seconds, until fitted
DECAY = 0.97  # the weight an older decode sample keeps per newer one
MIN_SPREAD = 1.0  # rows: below this spread of batch sizes the slope stays the prior's


@dataclass(frozen=True)
class Traffic:
    """The load to serve: requests per second, and their mean prompt tokens to compute and
    mean output tokens."""

    rate: float
    prompt_tokens: float
    output_tokens: float

    @property
    def prompt_rate(self) -> float:
        return self.rate * self.prompt_tokens

    @property
    def output_rate(self) -> float:
        return self.rate * self.output_tokens


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float

    def meets(self, ttft_s: float, itl_s: float, headroom: float = 1.0) -> bool:
        return self.ttft_s <= headroom * ttft_s and self.itl_s <= headroom * itl_s


class StepModel:
    """Both roles' step times, fitted from warm workers' samples."""

    def __init__(self) -> None:
        self.token_s = PRIOR_TOKEN_S
        self._token_samples = 0
        self._steps = DecayedLine(DECAY)  # (rows, seconds) of warm decode steps

    def add_prefill(self, token_s: float) -> None:
        """A warm prefill worker's learnt compute time of a prompt token."""
        if token_s > 0:
            self._token_samples += 1
            weight = max(1.0 / self._token_samples, 1.0 - DECAY)
            self.token_s += weight * (token_s - self.token_s)

    def add_decode(self, rows: float, step_s: float) -> None:
        """A warm decode worker's recent step time at ``rows`` rows."""
        if step_s <= 0 or rows < 0:
            return
        self._steps.add(rows, step_s)

    @property
    def decode_step(self) -> tuple[float, float]:
        """``(c, d)``: a decode step of ``b`` rows takes ``c + d·b`` seconds."""
        moments = self._steps.moments()
        if moments is None:
            return PRIOR_STEP
        mean_x, mean_y, spread, covariance = moments
        slope = PRIOR_STEP[1]
        if spread >= MIN_SPREAD:
            slope = max(covariance / spread, 0.0)
        return max(mean_y - slope * mean_x, 1e-4), slope

    def predict(
        self, prefills: int, decodes: int, traffic: Traffic, queued: float = 0.0
    ) -> Prediction:
        """TTFT and ITL with ``prefills`` and ``decodes`` workers serving ``traffic``,
        ``queued`` prompt tokens waiting already."""
        return Prediction(self._ttft(prefills, traffic, queued), self._itl(decodes, traffic))

    def _ttft(self, prefills: int, traffic: Traffic, queued: float) -> float:
        if prefills <= 0:
            return math.inf if traffic.rate > 0 or queued > 0 else 0.0
        token_s = self.token_s
        backlog = queued * token_s / prefills
        service = traffic.prompt_tokens * token_s
        busy = traffic.prompt_rate * token_s / prefills
        if busy >= 1.0:
            return math.inf
        return backlog + service + service * busy / (2.0 * (1.0 - busy))

    def _itl(self, decodes: int, traffic: Traffic) -> float:
        fixed, per_row = self.decode_step
        if decodes <= 0:
            return math.inf if traffic.rate > 0 else fixed
        load = per_row * traffic.output_rate / decodes
        if load >= 1.0:
            return math.inf
        return fixed / (1.0 - load)
