"""The planner in the simulator (testbed/planner_sim.py): a light load is served in full by any
sensible split; under a shifting mix the planner beats every fixed split; under a constant mix
it settles and stays still; and a scale-down moves work off the worker before it goes."""

from __future__ import annotations

from coordinator.planner.planner import Planner, PlannerConfig
from testbed.planner_sim import Arrival, WorkerModel, shifting_trace, simulate

MODEL = WorkerModel(token_s=0.001, step_fixed_s=0.008, step_row_s=0.0016)
WORKERS = 6


def _planner() -> Planner:
    return Planner(PlannerConfig(default_prefill=WORKERS // 2, default_decode=WORKERS // 2))


def test_a_light_load_is_all_good():
    trace = [Arrival(0.5 * i, 200, 20) for i in range(60)]
    result = simulate(trace, MODEL, 3, 3)
    assert result.requests == 60 and result.goodput == 1.0


def test_under_a_shifting_mix_the_planner_beats_every_fixed_split():
    trace = shifting_trace(5, MODEL, WORKERS, duration_s=240.0, phase_s=60.0)
    fixed = max(simulate(trace, MODEL, p, WORKERS - p).goodput for p in range(1, WORKERS))
    planned = simulate(trace, MODEL, WORKERS // 2, WORKERS // 2, _planner())
    assert planned.goodput >= 1.3 * fixed
    assert planned.switches >= 2  # it followed the mix both ways
    assert max(planned.reaction_intervals(), default=0) <= 3


def test_under_a_constant_mix_it_settles_and_stays():
    trace = shifting_trace(7, MODEL, WORKERS, duration_s=240.0, phase_s=10_000.0)
    result = simulate(trace, MODEL, WORKERS // 2, WORKERS // 2, _planner())
    assert [t for t, _ in result.moves if t > 60.0] == []
    assert result.goodput > 0.9


def test_a_released_worker_hands_its_requests_over_first():
    config = PlannerConfig(default_prefill=1, default_decode=1, scale_down_after_s=10.0)
    trace = [Arrival(0.5 * i, 100, 200) for i in range(120)]  # decoding all along
    result = simulate(trace, MODEL, 2, 3, Planner(config), drain_s=100.0)
    released = [d for _, d in result.moves if d.kind == "scale_down"]
    assert released and result.roles[-1][1:] == (1, 1)
    assert result.good == result.requests  # nothing lost to a release
