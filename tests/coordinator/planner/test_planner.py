"""The planner's fast loop (unit level): which move a violated target gets, the consolidation
check, cooldown and anti-flapping, idle pools going back to their configured split, and step
times learnt only from warm workers."""

from __future__ import annotations

import math

from coordinator.planner.capacity import StepModel, Traffic
from coordinator.planner.planner import (
    DECODE,
    NONE,
    PREFILL,
    SCALE_DOWN,
    SCALE_UP,
    SWITCH,
    Planner,
    PlannerConfig,
    TrafficSample,
    WorkerSample,
)

CONFIG = PlannerConfig(slo_ttft_s=2.0, slo_itl_s=0.1, default_prefill=2, default_decode=2)


def _pool(prefills: int, decodes: int, queued: int = 0, running: int = 2) -> list[WorkerSample]:
    return [
        WorkerSample(f"p{i}", PREFILL, queued_tokens=queued, token_s=0.001) for i in range(prefills)
    ] + [
        WorkerSample(f"d{i}", DECODE, running=running + i, step_s=0.02 + 0.002 * (running + i))
        for i in range(decodes)
    ]


def _traffic(ttft: float, itl: float, rate: float = 2.0, prompt: float = 400, output: float = 40):
    return TrafficSample(window_s=10.0, arrivals=int(rate * 10), prompt_tokens=prompt,
                         output_tokens=output, ttft_p90_s=ttft, itl_p90_s=itl)  # fmt: skip


def test_a_violated_ttft_takes_the_least_busy_decode_workers():
    planner = Planner(CONFIG)
    decision = planner.decide(_pool(2, 6), _traffic(ttft=3.0, itl=0.03), now=100.0)
    assert decision.kind == SWITCH and decision.role == PREFILL
    assert decision.workers[0] == "d0"  # the fewest running requests: the fewest to migrate
    assert decision.after is not None and decision.before is not None
    assert decision.after.ttft_s < decision.before.ttft_s
    assert decision.after.itl_s <= CONFIG.headroom * CONFIG.slo_itl_s


def test_a_violated_itl_takes_prefill_workers_while_ttft_keeps():
    planner = Planner(CONFIG)
    decision = planner.decide(_pool(6, 2, running=30), _traffic(ttft=0.3, itl=0.2, prompt=100,
                                                                output=400), now=100.0)  # fmt: skip
    assert decision.kind == SWITCH and decision.role == DECODE
    assert all(key.startswith("p") for key in decision.workers)


def test_no_switch_that_breaks_the_other_target_but_a_worker_asked_for():
    # decode is as short as prefill: taking a decode worker would break ITL
    busy = _traffic(ttft=3.0, itl=0.09, rate=8.0, output=200)
    planner = Planner(CONFIG)
    refused = planner.decide(_pool(2, 2, running=60), busy, now=100.0)
    assert refused.kind == NONE and "no worker can be added" in refused.reason
    growing = Planner(PlannerConfig(**{**CONFIG.__dict__, "max_workers": 8}))
    asked = growing.decide(_pool(2, 2, running=60), busy, now=100.0)
    assert asked.kind == SCALE_UP and asked.role == PREFILL


def test_nothing_moves_during_a_move_nor_in_its_cooldown():
    planner = Planner(CONFIG)
    violated = _traffic(ttft=3.0, itl=0.03)
    pool = _pool(2, 6)
    switching = [*pool[:-1], WorkerSample("d5", DECODE, switching=True)]
    assert planner.decide(switching, violated, now=100.0).kind == NONE
    assert planner.decide(pool, violated, now=100.0).kind == SWITCH
    assert planner.decide(pool, violated, now=100.5).reason.startswith("cooling down")


def test_undoing_the_last_move_needs_two_intervals_of_violation():
    planner = Planner(CONFIG)
    assert planner.decide(_pool(2, 6), _traffic(ttft=3.0, itl=0.03), now=100.0).kind == SWITCH
    itl_short = _traffic(ttft=0.3, itl=0.2, prompt=100, output=400)
    first = planner.decide(_pool(6, 2, running=30), itl_short, now=102.0)
    assert first.kind == NONE and "just after a move the other way" in first.reason
    assert planner.decide(_pool(6, 2, running=30), itl_short, now=104.0).kind == SWITCH


def test_an_idle_pool_goes_back_to_its_configured_workers_and_split():
    planner = Planner(PlannerConfig(**{**CONFIG.__dict__, "scale_down_after_s": 30.0}))
    idle = TrafficSample(window_s=10.0)
    pool = _pool(4, 1, running=0)
    assert planner.decide(pool, idle, now=0.0).reason == "idle"
    released = planner.decide(pool, idle, now=31.0)
    assert released.kind == SCALE_DOWN and released.role == PREFILL
    back = planner.decide(_pool(3, 1, running=0), idle, now=40.0)
    assert back.kind == SWITCH and back.role == DECODE  # 3/1 -> the configured 2/2
    assert planner.decide(_pool(2, 2, running=0), idle, now=50.0).kind == NONE


def test_a_backlog_is_a_ttft_violation_before_any_first_token_says_so():
    planner = Planner(CONFIG)
    quiet = _traffic(ttft=0.5, itl=0.03)  # the measured p90 still looks fine
    decision = planner.decide(_pool(2, 6, queued=5000), quiet, now=100.0)  # 2.5 s of work each
    assert decision.kind == SWITCH and decision.role == PREFILL


def test_cold_workers_teach_the_model_nothing():
    planner = Planner(CONFIG)
    cold = [WorkerSample("p0", PREFILL, token_s=0.05, warm=False),
            WorkerSample("d0", DECODE, running=4, step_s=5.0, warm=False)]  # fmt: skip
    planner.decide(cold, _traffic(ttft=0.1, itl=0.01), now=1.0)
    fresh = StepModel()
    assert planner.model.token_s == fresh.token_s
    assert planner.model.decode_step == fresh.decode_step


def test_the_step_model_fits_what_it_is_shown():
    model = StepModel()
    for rows in (1, 4, 8, 16, 32) * 10:
        model.add_decode(rows, 0.01 + 0.001 * rows)
    fixed, per_row = model.decode_step
    assert math.isclose(fixed, 0.01, rel_tol=1e-6) and math.isclose(per_row, 0.001, rel_tol=1e-6)
    traffic = Traffic(rate=10.0, prompt_tokens=100, output_tokens=50)
    prediction = model.predict(1, 2, traffic)
    assert math.isclose(prediction.itl_s, 0.01 / (1 - 0.001 * 500 / 2))
    assert model.predict(1, 0, traffic).itl_s == math.inf
    assert model.predict(0, 2, traffic).ttft_s == math.inf


def test_an_idle_pool_at_its_configured_split_releases_nothing():
    planner = Planner(PlannerConfig(default_prefill=1, default_decode=1, scale_down_after_s=1.0))
    idle = TrafficSample(window_s=2.0)
    pool = _pool(1, 1, running=0)
    for now in (0.0, 2.0, 4.0, 60.0):
        assert planner.decide(pool, idle, now=now).kind == NONE
