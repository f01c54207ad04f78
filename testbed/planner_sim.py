"""A replay of a request trace on modelled prefill/decode workers, with the real planner
(``coordinator/planner``) in the loop: how it would move workers at sizes this machine cannot
hold, and whether it stays still when it should.

Workers follow :class:`WorkerModel`, fitted from pdserve's own measured step times
(``benchmarks/planner/shifting_mix.py`` measures them): a prefill worker computes its queue's
prompts in turn at ``token_s`` a token; a decode worker steps all its requests together, a step
of ``b`` rows taking ``step_fixed_s + step_row_s·b``. Time advances in ``TICK_S`` ticks. A
request's prompt goes to the prefill worker with the fewest queued tokens, then (``handoff_s``
later) to the decode worker with the fewest requests. A worker started or switched runs
``cold_factor`` slower for ``cold_s``, and says so (the planner must not learn from it).

Moves, as the planner decides them: a **switch** takes the worker out of its role at once (its
decode requests migrate to the other decode workers, each costing ``handoff_s`` plus the
recompute of its outputs so far; its queued prompts go to the other prefill workers but the one
being computed finishes), pauses ``switch_s``, then serves its new role; a **scale-up** adds a
worker ``start_s`` later; a **scale-down** empties a worker as a switch does and removes it.

A request is *good* when its TTFT is within ``slo_ttft_s`` and its mean ITL within
``slo_itl_s``; :class:`SimResult` counts them.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from coordinator.planner.planner import (
    DECODE,
    PREFILL,
    SCALE_UP,
    SWITCH,
    Decision,
    Planner,
    PlannerConfig,
    TrafficSample,
    WorkerSample,
)

TICK_S = 0.02


@dataclass(frozen=True)
class WorkerModel:
    token_s: float  # a prompt token's compute
    step_fixed_s: float  # a decode step's fixed part ...
    step_row_s: float  # ... and its part per row
    handoff_s: float = 0.01
    switch_s: float = 1.0
    start_s: float = 30.0
    cold_s: float = 5.0
    cold_factor: float = 2.0
    max_batch: int = 64  # a decode worker's requests at once (maxBatchSize); the rest wait
    give_up_s: float = 10.0  # a request waiting this long for a worker fails (its timeout)


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt: int
    output: int


@dataclass
class _Request:
    arrival: Arrival
    first_at: float | None = None
    last_at: float | None = None
    done: int = 0  # output tokens made

    @property
    def finished(self) -> bool:
        return self.done >= self.arrival.output


@dataclass
class _Worker:
    key: str
    role: str
    ready_at: float  # serving from then on (a start or a switch)
    queue: deque = field(default_factory=deque)  # prefill: [request, tokens left]
    running: list = field(default_factory=list)  # decode: requests
    joining: list = field(default_factory=list)  # decode: (ready time, request)
    step_left: float = 0.0  # decode: seconds left in the current step
    step_s: float = 0.0
    step_rows: int = 0  # rows of the last step
    draining_to: str | None = None  # finishing its current prompt before a switch
    removed: bool = False

    def queued_tokens(self) -> int:
        return int(sum(left for _, left in self.queue))


@dataclass
class SimResult:
    requests: int
    good: int
    moves: list[tuple[float, Decision]]
    roles: list[tuple[float, int, int]]  # (time, prefill workers, decode workers) per interval
    # per planner call: (time, roles short then, whether it moved, whether a move could help)
    calls: list[tuple[float, tuple[str, ...], bool, bool]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.good / self.requests if self.requests else 1.0

    def reaction_intervals(self) -> list[int]:
        """For each violation's onset (a call finding a role short after one that found none),
        the planner calls until the first that moved, that one included; an onset that ended
        with no move, or during which the planner found no move that could fix it (no worker
        to spare, none to add), has no such move and is left out."""
        waits: list[int] = []
        waiting: int | None = None
        previous: tuple[str, ...] = ()
        for _, short, moved, fixable in self.calls:
            if short and not previous and waiting is None:
                waiting = 0
            if waiting is not None:
                waiting += 1
                if moved:
                    waits.append(waiting)
                    waiting = None
                elif not fixable or not short:
                    waiting = None
            previous = short
        return waits

    @property
    def switches(self) -> int:
        return sum(1 for _, d in self.moves if d.kind == SWITCH)


def simulate(
    trace: list[Arrival],
    model: WorkerModel,
    prefills: int,
    decodes: int,
    planner: Planner | None = None,
    drain_s: float = 60.0,
    slo: PlannerConfig | None = None,
) -> SimResult:
    """``trace`` on ``prefills`` + ``decodes`` workers, the planner (if any) deciding every
    ``planner.config.interval_s``; requests judged by the planner's targets (else ``slo``'s,
    else the defaults)."""
    targets = planner.config if planner is not None else slo or PlannerConfig()
    sim = _Sim(model, prefills, decodes, planner, (targets.slo_ttft_s, targets.slo_itl_s))
    end = (trace[-1].at if trace else 0.0) + drain_s
    pending = deque(trace)
    while sim.now < end:
        while pending and pending[0].at <= sim.now:
            sim.arrive(pending.popleft())
        sim.tick()
        if not pending and all(r.finished for r in sim.requests):
            break
    return sim.result()


class _Sim:
    def __init__(
        self, model: WorkerModel, prefills: int, decodes: int, planner: Planner | None,
        targets: tuple[float, float],
    ) -> None:  # fmt: skip
        self.model, self.planner, self.now, self.targets = model, planner, 0.0, targets
        self.workers = [_Worker(f"w{i}", PREFILL if i < prefills else DECODE, 0.0)
                        for i in range(prefills + decodes)]  # fmt: skip
        self.requests: list[_Request] = []
        self.moves: list[tuple[float, Decision]] = []
        self.calls: list[tuple[float, tuple[str, ...], bool, bool]] = []
        self.roles: list[tuple[float, int, int]] = []
        self._next_plan = planner.config.interval_s if planner else float("inf")
        self._window: list[_Request] = []  # arrived in the planner's interval
        self._ttfts: list[float] = []
        self._gaps: list[tuple[float, int]] = []  # (step seconds, rows) in the interval
        self._starting: list[tuple[float, str]] = []  # (ready time, role)
        self._next_timeout = 0.0

    # ---- requests ----------------------------------------------------------------------------

    def arrive(self, arrival: Arrival) -> None:
        request = _Request(arrival)
        self.requests.append(request)
        self._window.append(request)
        self._to_prefill(request, arrival.prompt)

    def _serving(self, role: str) -> list[_Worker]:
        return [w for w in self.workers
                if w.role == role and not w.removed and w.draining_to is None]  # fmt: skip

    def _to_prefill(self, request: _Request, tokens: float) -> None:
        workers = self._serving(PREFILL)
        target = min(workers, key=lambda w: (w.queued_tokens(), w.key))
        target.queue.append([request, max(tokens, 1.0)])

    def _to_decode(self, request: _Request, at: float) -> None:
        workers = self._serving(DECODE)
        target = min(workers, key=lambda w: (len(w.running) + len(w.joining), w.key))
        target.joining.append((at, request))

    # ---- time --------------------------------------------------------------------------------

    def tick(self) -> None:
        now, dt = self.now, TICK_S
        for ready, role in [s for s in self._starting if s[0] <= now]:
            self._starting.remove((ready, role))
            self.workers.append(_Worker(f"w{len(self.workers)}", role, ready))
        if now >= self._next_timeout:
            self._next_timeout = now + 0.5
            self._time_out(now)
        for worker in self.workers:
            if worker.removed or worker.ready_at > now:
                continue
            slow = self.model.cold_factor if now < worker.ready_at + self.model.cold_s else 1.0
            if worker.role == PREFILL:
                self._prefill(worker, now, dt, slow)
            else:
                self._decode(worker, now, dt, slow)
        self.now = now + dt
        if self.now >= self._next_plan and self.planner is not None:
            self._next_plan += self.planner.config.interval_s
            self._plan()

    def _time_out(self, now: float) -> None:
        """Requests waiting for a worker longer than ``give_up_s`` fail (the coordinator's
        timeouts, its bounded queues): a prompt not started, a hand-off not taken into a batch."""
        late = now - self.model.give_up_s
        for worker in self.workers:
            if worker.queue:
                worker.queue = deque(
                    e for e in worker.queue if e[1] < e[0].arrival.prompt or e[0].arrival.at >= late
                )
            if worker.joining:
                worker.joining = [(at, r) for at, r in worker.joining if at >= late]

    def _prefill(self, worker: _Worker, now: float, dt: float, slow: float) -> None:
        budget, token_s = dt, self.model.token_s * slow
        while budget > 0 and worker.queue:
            request, left = worker.queue[0]
            need = left * token_s
            if need > budget:
                worker.queue[0][1] = left - budget / token_s
                return
            budget -= need
            worker.queue.popleft()
            done_at = now + dt - budget
            if request.first_at is None:
                request.first_at = request.last_at = done_at
                request.done = 1
                self._ttfts.append(done_at - request.arrival.at)
            if not request.finished:
                self._to_decode(request, done_at + self.model.handoff_s)
            if worker.draining_to is not None:
                self._flip(worker, now + dt)
                return
        if worker.draining_to is not None and not worker.queue:
            self._flip(worker, now + dt)

    def _decode(self, worker: _Worker, now: float, dt: float, slow: float) -> None:
        elapsed = dt
        while elapsed > 0:
            if worker.step_left <= 0:
                room = self.model.max_batch - len(worker.running)
                ready = [(at, r) for at, r in worker.joining if at <= now][: max(room, 0)]
                worker.joining = [e for e in worker.joining if e not in ready]
                worker.running += [r for _, r in ready]
                if not worker.running:
                    return
                rows = worker.step_rows = len(worker.running)
                worker.step_s = (self.model.step_fixed_s + self.model.step_row_s * rows) * slow
                worker.step_left = worker.step_s
            if worker.step_left > elapsed:
                worker.step_left -= elapsed
                return
            elapsed -= worker.step_left
            worker.step_left = 0.0
            at = now + dt - elapsed
            self._gaps.append((worker.step_s, len(worker.running)))
            for request in worker.running:
                request.done += 1
                request.last_at = at
            worker.running = [r for r in worker.running if not r.finished]

    # ---- the planner -------------------------------------------------------------------------

    def _plan(self) -> None:
        assert self.planner is not None
        live = [w for w in self.workers if not w.removed]
        self.roles.append((self.now, *_split(live)))
        samples = [self._sample(w) for w in live]
        window = self._window
        sample = TrafficSample(
            window_s=self.planner.config.interval_s,
            arrivals=len(window),
            prompt_tokens=_mean([r.arrival.prompt for r in window]),
            output_tokens=_mean([r.arrival.output for r in window]),
            ttft_p90_s=_p90([(t, 1) for t in self._ttfts]),
            itl_p90_s=_p90(self._gaps),
            starting=len(self._starting),
        )
        self._window, self._ttfts, self._gaps = [], [], []
        decision = self.planner.decide(samples, sample, self.now)
        moved = decision.kind != "none"
        fixable = "no worker can be added" not in decision.reason
        self.calls.append((self.now, tuple(self.planner.short), moved, fixable))
        if decision.kind != "none":
            self.moves.append((self.now, decision))
            self._carry_out(decision)

    def _sample(self, worker: _Worker) -> WorkerSample:
        cold = self.now < worker.ready_at + self.model.cold_s
        slow = self.model.cold_factor if cold else 1.0
        switching = worker.ready_at > self.now or worker.draining_to is not None
        return WorkerSample(
            worker.key, worker.role, worker.queued_tokens(),
            len(worker.running) + len(worker.joining), self.model.token_s * slow,
            worker.step_s, worker.step_rows, warm=not cold, switching=switching,
        )  # fmt: skip

    def _carry_out(self, decision: Decision) -> None:
        if decision.kind == SCALE_UP:
            assert decision.role is not None
            self._starting.append((self.now + self.model.start_s, decision.role))
            return
        for key in decision.workers:
            worker = next(w for w in self.workers if w.key == key)
            self._empty(worker, decision.role if decision.kind == SWITCH else None)

    def _empty(self, worker: _Worker, to_role: str | None) -> None:
        """Move the worker's work elsewhere; then it switches to ``to_role`` or (None) goes."""
        now = self.now
        worker.draining_to = to_role or "gone"
        if worker.role == DECODE:
            moving = worker.running + [r for _, r in worker.joining]
            worker.running, worker.joining, worker.step_left = [], [], 0.0
            for request in moving:
                cost = self.model.handoff_s + request.done * self.model.token_s
                self._to_decode(request, now + cost)
            self._flip(worker, now)
            return
        waiting = list(worker.queue)[1:]
        worker.queue = deque(list(worker.queue)[:1])
        for request, left in waiting:
            self._to_prefill(request, left)
        if not worker.queue:
            self._flip(worker, now)

    def _flip(self, worker: _Worker, now: float) -> None:
        target = worker.draining_to
        worker.draining_to = None
        if target == "gone":
            worker.removed = True
            return
        assert target is not None
        worker.role, worker.ready_at, worker.step_s = target, now + self.model.switch_s, 0.0

    def result(self) -> SimResult:
        good = sum(1 for r in self.requests if self._good(r))
        return SimResult(len(self.requests), good, self.moves, self.roles, self.calls)

    def _good(self, request: _Request) -> bool:
        ttft_s, itl_s = self.targets
        if request.first_at is None or not request.finished or request.last_at is None:
            return False
        if request.first_at - request.arrival.at > ttft_s:
            return False
        gaps = request.arrival.output - 1
        return gaps <= 0 or (request.last_at - request.first_at) / gaps <= itl_s


def _split(workers: list[_Worker]) -> tuple[int, int]:
    prefills = sum(1 for w in workers if w.role == PREFILL)
    return prefills, len(workers) - prefills


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _p90(weighted: list[tuple[float, int]]) -> float | None:
    """The 90th percentile of values each counted ``weight`` times."""
    if not weighted:
        return None
    ordered = sorted(weighted)
    total = sum(w for _, w in ordered)
    seen = 0
    for value, weight in ordered:
        seen += weight
        if seen >= 0.9 * total:
            return value
    return ordered[-1][0]


def shifting_trace(
    seed: int,
    model: WorkerModel,
    workers: int,
    duration_s: float = 600.0,
    phase_s: float = 120.0,
    load: float = 0.7,
    itl_target_s: float = 0.1,
    ttft_target_s: float = 2.0,
) -> list[Arrival]:
    """Poisson arrivals whose mix shifts between prompt-heavy and output-heavy phases of about
    ``phase_s`` (drawn from 0.7 to 1.3 times that): prompts of a quarter of the TTFT target's
    compute and 16-token answers, then prompts a tenth of that and 256-token answers. Each phase's
    rate keeps ``workers`` busy ``load`` of the time at the split that suits it best."""
    rng = random.Random(seed)
    long_prompt = max(int(0.25 * ttft_target_s / model.token_s), 16)
    mixes = ((long_prompt, 16), (max(long_prompt // 10, 8), 256))
    arrivals: list[Arrival] = []
    at, phase = 0.0, rng.randrange(2)
    while at < duration_s:
        end = min(at + phase_s * rng.uniform(0.7, 1.3), duration_s)
        prompt, output = mixes[phase]
        rate = _rate(model, workers, prompt, output, load, itl_target_s)
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            arrivals.append(Arrival(at, max(int(rng.gauss(prompt, prompt / 4)), 8),
                                    max(int(rng.gauss(output, output / 4)), 2)))  # fmt: skip
        at, phase = end, 1 - phase
    return arrivals


def _rate(model: WorkerModel, workers: int, prompt: float, output: float, load: float,
          itl_target_s: float) -> float:  # fmt: skip
    """Requests per second that ``workers`` serve at ``load`` with their best split: prefill
    workers busy ``load`` of the time, decode workers at an ITL of ``load`` × the target."""
    prefill_per_request = prompt * model.token_s / load
    itl = load * itl_target_s
    if itl <= model.step_fixed_s:
        raise ValueError(f"an ITL target of {itl_target_s} s is below a decode step's fixed part")
    decode_per_request = model.step_row_s * output / (1 - model.step_fixed_s / itl)
    return workers / (prefill_per_request + decode_per_request)
