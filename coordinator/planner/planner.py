"""The planner's fast loop: every ``interval_s``, at most one move (workers switching roles, one
more worker asked for, or one released) that fixes a violated target without breaking the other.

Each call of :meth:`Planner.decide` gets the workers as the last poll saw them
(:class:`WorkerSample`) and the traffic of the last interval (:class:`TrafficSample`); it answers
a :class:`Decision` with its reason (``none`` too: why nothing moved).

- **Violated**: TTFT, when the interval's p90 TTFT passed ``slo_ttft_s`` or the prompt tokens
  already queued would keep a new prompt waiting longer than that (a queue grows before the
  first tokens that measure it arrive); ITL, when the interval's p90 ITL passed ``slo_itl_s``.
- **A switch** takes workers from the other role when the step-time model (``capacity.py``)
  predicts, for the split after the move, the violated target better than now and the other
  within ``headroom`` of its target (the consolidation check: a role keeps the workers it needs):
  the fewest that meet the violated target again, at most one, or ``max_move_share`` of a larger
  pool (a shift of mix on 64 workers needs dozens of moves, not one per interval). The workers
  taken: decode workers with the fewest running requests (the fewest to migrate), prefill
  workers with the fewest queued prompt tokens. Both targets violated: the one further past its
  target is fixed first.
- **Scaling** (``max_workers`` above the workers there are): when no switch passes the check, one
  worker of the short role is asked for; one is released after ``scale_down_after_s`` during
  which the best split of one worker fewer kept both targets within ``headroom²``.
- **Idle** (no request, nothing queued or running) for ``scale_down_after_s``: workers beyond
  ``min_workers`` are released, then roles return to the configured split, one a decision.
- **Stability**: nothing moves while a switch or a start is in progress, nor for
  ``cooldown_intervals`` intervals after a move; a move undoing the last one in the
  ``flap_intervals`` intervals after it needs its violation in two intervals running (no 2 ↔ 1
  flapping on a noisy target); only warm workers' figures fit the step times (a start or a
  switch makes a worker cold for its first steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.planner.capacity import Prediction, StepModel, Traffic

PREFILL, DECODE = "prefill", "decode"
NONE, SWITCH, SCALE_UP, SCALE_DOWN = "none", "switch", "scale_up", "scale_down"
KINDS = (NONE, SWITCH, SCALE_UP, SCALE_DOWN)


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.1
    interval_s: float = 2.0
    cooldown_intervals: float = 0.75  # after a move, none for this long (the next may move)
    flap_intervals: int = 2  # undoing a move this soon needs two intervals of violation
    headroom: float = 0.9  # a prediction within this share of a target keeps it
    default_prefill: int = 1  # the configured split, where idle roles return
    default_decode: int = 1
    min_prefill: int = 1
    min_decode: int = 1
    max_workers: int = 0  # 0: this many as there are (switches only)
    max_move_share: float = 0.5  # a decision switches at most this share of the pool (or one)
    scale_down_after_s: float = 60.0

    @property
    def min_workers(self) -> int:
        return self.default_prefill + self.default_decode


@dataclass(frozen=True)
class WorkerSample:
    key: str
    role: str
    queued_tokens: int = 0  # prompt tokens waiting to be computed
    running: int = 0  # requests decoding
    token_s: float = 0.0  # its learnt compute time of a prompt token (0: none yet)
    step_s: float = 0.0  # its recent decode step time (0: nothing new since the last sample)
    step_rows: float = 0.0  # the rows of those steps (0: as many as it runs)
    warm: bool = True  # past its first steps since a start or a switch
    switching: bool = False


@dataclass(frozen=True)
class TrafficSample:
    """The last interval: requests that arrived, their mean prompt tokens to compute and mean
    output tokens, and the p90 TTFT and ITL measured (None: nothing measured)."""

    window_s: float
    arrivals: int = 0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    starting: int = 0  # workers asked for and not up yet

    @property
    def traffic(self) -> Traffic:
        rate = self.arrivals / self.window_s if self.window_s > 0 else 0.0
        return Traffic(rate, self.prompt_tokens, self.output_tokens)


@dataclass(frozen=True)
class Decision:
    kind: str
    reason: str
    workers: tuple[str, ...] = ()  # the workers switched, or the one released
    role: str | None = None  # the role it takes (switch) or of the one asked for (scale_up)
    before: Prediction | None = None
    after: Prediction | None = None


@dataclass
class _Move:
    kind: str
    role: str | None
    at: float


@dataclass
class Planner:
    config: PlannerConfig = field(default_factory=PlannerConfig)
    model: StepModel = field(default_factory=StepModel)
    _last: _Move | None = None
    _idle_since: float | None = None
    _slack_since: float | None = None
    _streak: dict[str, int] = field(default_factory=dict)  # role short -> intervals running
    short: list[str] = field(default_factory=list)  # the roles short at the last decision

    def decide(self, workers: list[WorkerSample], sample: TrafficSample, now: float) -> Decision:
        for worker in workers:
            if worker.warm and not worker.switching:
                if worker.role == PREFILL:
                    self.model.add_prefill(worker.token_s)
                elif worker.step_rows or worker.running:
                    self.model.add_decode(worker.step_rows or worker.running, worker.step_s)
        self.short = []
        if any(w.switching for w in workers) or sample.starting:
            return Decision(NONE, "a move is in progress")
        idle = sample.arrivals == 0 and not any(w.queued_tokens or w.running for w in workers)
        if idle:
            return self._idle(workers, now)
        self._idle_since = None
        short = self._violated(workers, sample)
        self.short = short
        for role in (PREFILL, DECODE):
            self._streak[role] = self._streak.get(role, 0) + 1 if role in short else 0
        cooldown = self.config.cooldown_intervals * self.config.interval_s
        if self._last is not None and now < self._last.at + cooldown:
            return Decision(NONE, "cooling down after the last move")
        if len(short) == 2:
            return self._fix(workers, sample, self._further(sample), now)
        if short:
            return self._fix(workers, sample, short[0], now)
        return self._maybe_release(workers, sample, now)

    # ---- the parts ---------------------------------------------------------------------------

    def _violated(self, workers: list[WorkerSample], sample: TrafficSample) -> list[str]:
        """The roles short of workers: ``prefill`` for TTFT, ``decode`` for ITL."""
        cfg = self.config
        prefills = [w for w in workers if w.role == PREFILL]
        queued = sum(w.queued_tokens for w in prefills)
        backlog_s = queued * self.model.token_s / max(len(prefills), 1)
        short = []
        if (sample.ttft_p90_s or 0.0) > cfg.slo_ttft_s or backlog_s > cfg.slo_ttft_s:
            short.append(PREFILL)
        if (sample.itl_p90_s or 0.0) > cfg.slo_itl_s:
            short.append(DECODE)
        return short

    def _fix(
        self, workers: list[WorkerSample], sample: TrafficSample, short: str, now: float
    ) -> Decision:
        """Switch the fewest workers from the other role (at most ``max_moves``) that the model
        says meet the violated target again while the other keeps its own; if none does, the
        most that still keep the other, as long as they help; else ask for a worker."""
        cfg = self.config
        other = DECODE if short == PREFILL else PREFILL
        if self._undoes_last(short, now) and self._streak.get(short, 0) < 2:
            return Decision(NONE, f"{short} short once just after a move the other way")
        prefills, decodes = _count(workers)
        queued = sum(w.queued_tokens for w in workers if w.role == PREFILL)
        traffic, sign = sample.traffic, 1 if short == PREFILL else -1
        before = self.model.predict(prefills, decodes, traffic, queued)
        spare = (decodes - cfg.min_decode) if short == PREFILL else (prefills - cfg.min_prefill)
        chosen, after = 0, before
        for count in range(1, min(spare, self.max_moves(len(workers))) + 1):
            moved = self.model.predict(prefills + sign * count, decodes - sign * count, traffic,
                                       queued)  # fmt: skip
            if not (_keeps(other, moved, cfg) and _helps(short, before, moved)):
                break
            chosen, after = count, moved
            if _keeps(short, moved, cfg):
                break
        if chosen:
            self._last = _Move(SWITCH, short, now)
            target = "TTFT" if short == PREFILL else "ITL"
            return Decision(SWITCH, f"{target} violated; {chosen} {other} worker(s) fewer keep "
                            "the other target", _cheapest(workers, other, chosen), short,
                            before, after)  # fmt: skip
        return self._scale_up(workers, short, now, f"{short} short; no switch keeps both targets",
                              before)  # fmt: skip

    def max_moves(self, num_workers: int) -> int:
        """Workers one decision may switch: one, or ``max_move_share`` of a larger pool."""
        return max(1, int(num_workers * self.config.max_move_share))

    def _further(self, sample: TrafficSample) -> str:
        """Of two violated targets, the role whose measured figure is further past its own."""
        cfg = self.config
        ttft = (sample.ttft_p90_s or 0.0) / cfg.slo_ttft_s
        itl = (sample.itl_p90_s or 0.0) / cfg.slo_itl_s
        return PREFILL if ttft >= itl else DECODE

    def _undoes_last(self, short: str, now: float) -> bool:
        """Whether a switch to ``short`` undoes the last move, made in the last
        ``flap_intervals`` intervals."""
        last = self._last
        other = DECODE if short == PREFILL else PREFILL
        window = (self.config.flap_intervals + 0.5) * self.config.interval_s
        recent = last is not None and now < last.at + window
        return recent and last is not None and last.kind == SWITCH and last.role == other

    def _scale_up(self, workers: list[WorkerSample], role: str, now: float, reason: str,
                  before: Prediction | None = None) -> Decision:  # fmt: skip
        if self.config.max_workers > len(workers):
            self._last = _Move(SCALE_UP, role, now)
            return Decision(SCALE_UP, reason, (), role, before)
        return Decision(NONE, f"{reason}, and no worker can be added", before=before)

    def _maybe_release(
        self, workers: list[WorkerSample], sample: TrafficSample, now: float
    ) -> Decision:
        """Targets met: one worker fewer once the best split of the rest kept them with room
        for ``scale_down_after_s``."""
        cfg = self.config
        if len(workers) <= cfg.min_workers:
            self._slack_since = None
            return Decision(NONE, "targets met")
        queued = sum(w.queued_tokens for w in workers if w.role == PREFILL)
        best = self._best_split(len(workers) - 1, sample.traffic, queued)
        if best is None:
            self._slack_since = None
            return Decision(NONE, "targets met; one worker fewer would not keep them")
        if self._slack_since is None:
            self._slack_since = now
        if now < self._slack_since + cfg.scale_down_after_s:
            return Decision(NONE, "targets met; watching for room to release a worker")
        prefills, _ = _count(workers)
        role = PREFILL if prefills > best[0] else DECODE
        self._slack_since, self._last = None, _Move(SCALE_DOWN, role, now)
        return Decision(SCALE_DOWN, "targets met with room by one worker fewer",
                        _cheapest(workers, role), role)  # fmt: skip

    def _best_split(self, total: int, traffic: Traffic, queued: float) -> tuple[int, int] | None:
        cfg, best, best_slack = self.config, None, -math.inf
        for prefills in range(cfg.min_prefill, total - cfg.min_decode + 1):
            prediction = self.model.predict(prefills, total - prefills, traffic, queued)
            if not prediction.meets(cfg.slo_ttft_s, cfg.slo_itl_s, cfg.headroom**2):
                continue
            slack = min(
                1 - prediction.ttft_s / cfg.slo_ttft_s, 1 - prediction.itl_s / cfg.slo_itl_s
            )
            if slack > best_slack:
                best, best_slack = (prefills, total - prefills), slack
        return best

    def _idle(self, workers: list[WorkerSample], now: float) -> Decision:
        cfg = self.config
        if self._idle_since is None:
            self._idle_since = now
        if now < self._idle_since + cfg.scale_down_after_s:
            return Decision(NONE, "idle")
        prefills, decodes = _count(workers)
        spare_prefill, spare_decode = prefills - cfg.default_prefill, decodes - cfg.default_decode
        if len(workers) > cfg.min_workers and max(spare_prefill, spare_decode) > 0:
            role = PREFILL if spare_prefill >= spare_decode else DECODE
            self._last = _Move(SCALE_DOWN, role, now)
            return Decision(SCALE_DOWN, "idle: back to the configured workers",
                            _cheapest(workers, role), role)  # fmt: skip
        if prefills > cfg.default_prefill and decodes < cfg.default_decode:
            self._last = _Move(SWITCH, DECODE, now)
            return Decision(
                SWITCH, "idle: back to the configured split", _cheapest(workers, PREFILL), DECODE
            )
        if decodes > cfg.default_decode and prefills < cfg.default_prefill:
            self._last = _Move(SWITCH, PREFILL, now)
            return Decision(
                SWITCH, "idle: back to the configured split", _cheapest(workers, DECODE), PREFILL
            )
        return Decision(NONE, "idle")


def _count(workers: list[WorkerSample]) -> tuple[int, int]:
    prefills = sum(1 for w in workers if w.role == PREFILL)
    return prefills, len(workers) - prefills


def _cheapest(workers: list[WorkerSample], role: str, count: int = 1) -> tuple[str, ...]:
    """The ``count`` workers of ``role`` whose moves cost least: the fewest requests on them."""
    of_role = sorted((w for w in workers if w.role == role),
                     key=lambda w: (w.running, w.queued_tokens, w.key))  # fmt: skip
    return tuple(w.key for w in of_role[:count])


def _helps(short: str, before: Prediction, after: Prediction) -> bool:
    if short == PREFILL:
        return after.ttft_s < before.ttft_s or math.isinf(before.ttft_s)
    return after.itl_s < before.itl_s or math.isinf(before.itl_s)


def _keeps(role: str, after: Prediction, cfg: PlannerConfig) -> bool:
    """Whether ``role``'s target holds within ``headroom`` (for the role that gives workers up:
    the consolidation check)."""
    if role == PREFILL:
        return after.ttft_s <= cfg.headroom * cfg.slo_ttft_s
    return after.itl_s <= cfg.headroom * cfg.slo_itl_s
