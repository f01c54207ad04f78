"""The role planner in a coordinator (unit level): the traffic window it learns from, the lease
that lets one coordinator of a pool plan, and an interval's decision published as metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coordinator.planner import PlannerSettings
from coordinator.planner.capacity import StepModel
from coordinator.planner.loop import WARM_STEPS, PlannerLoop
from coordinator.planner.planner import Decision
from coordinator.planner.traffic import MAX_SAMPLES, TrafficWindow
from coordinator.planner_metrics import PlannerMetrics
from coordinator.routing.worker_state import WorkerState
from engine.errors import ConfigError
from engine.outputs import EngineStats
from workers.contracts import RoleState
from workers.leases import PlannerLease


def test_the_window_takes_an_intervals_figures_and_starts_afresh():
    window = TrafficWindow()
    for i in range(10):
        window.arrived(100 + 10 * i)
        window.finished(20, ttft_s=0.1 * (i + 1), itl_s=0.01)
    sample = window.take(5.0)
    assert sample.arrivals == 10 and sample.prompt_tokens == 145 and sample.output_tokens == 20
    assert sample.ttft_p90_s == pytest.approx(0.9) and sample.itl_p90_s == pytest.approx(0.01)
    assert sample.traffic.rate == 2.0
    empty = window.take(5.0)
    assert empty.arrivals == 0 and empty.ttft_p90_s is None
    assert empty.output_tokens == 20  # the last mean, while nothing finishes


def test_the_window_is_bounded_whatever_the_traffic():
    window = TrafficWindow()
    for _ in range(3 * MAX_SAMPLES):
        window.finished(5, ttft_s=1.0, itl_s=0.1)
    assert len(window._ttfts) == MAX_SAMPLES  # noqa: SLF001 - the bound itself


def test_one_coordinator_holds_the_lease_until_it_lapses():
    lease = PlannerLease()
    assert lease.claim("a", ttl_s=6.0, now=0.0)
    assert not lease.claim("b", ttl_s=6.0, now=3.0)
    assert lease.claim("a", ttl_s=6.0, now=5.0)  # renewed
    assert not lease.claim("b", ttl_s=6.0, now=10.0)
    assert lease.claim("b", ttl_s=6.0, now=11.5)  # a went silent
    assert not lease.claim("a", ttl_s=6.0, now=12.0)


def test_the_settings_refuse_an_unknown_mode():
    with pytest.raises(ConfigError, match="planner must be one of off, advise"):
        PlannerSettings(mode="auto")
    assert PlannerSettings(mode="execute").mode == "execute"


class _Claim:
    def __init__(self, lease: PlannerLease) -> None:
        self.lease = lease

    def remote(self, owner: str, ttl_s: float):
        async def answer() -> bool:
            return self.lease.claim(owner, ttl_s)

        return answer()


@dataclass
class _Worker:
    claim_planner: _Claim


@dataclass
class _Fleet:
    actors: list  # the first holds the planner's lease
    coordinator_id: str


@dataclass
class _View:
    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    latest_reports: list = field(default_factory=list)

    def all(self) -> list:
        return [*self.prefills, *self.decodes]


def _view() -> _View:
    warm = {"num_steps": WARM_STEPS, "prompt_token_seconds": 0.001}
    return _View(
        prefills=[
            WorkerState("prefill", 0, EngineStats(num_prompt_tokens_to_compute=9000, **warm))
        ],  # fmt: skip
        decodes=[
            WorkerState(
                "decode",
                i,
                EngineStats(
                    num_running=1 + i, decode_step_seconds=0.02, decode_step_rows=1 + i, **warm
                ),
            )  # fmt: skip
            for i in range(3)
        ],
    )


def test_the_coordinator_holding_the_lease_plans_and_publishes_it():
    lease, registry = PlannerLease(), CollectorRegistry()
    worker = _Worker(_Claim(lease))
    settings = PlannerSettings(mode="advise", slo_ttft_ms=2000, slo_itl_ms=100, interval_ms=2000)
    loops = []
    for name in ("a", "b"):
        fleet = _Fleet([worker, *[object()] * 3], name)
        metrics = PlannerMetrics(registry, "m") if name == "a" else None
        loops.append(PlannerLoop(settings, _view(), fleet, TrafficWindow(), (1, 3), metrics))
    first, second = loops
    for _ in range(3):
        first.traffic.arrived(500)
    decision = asyncio.run(first.tick(now=100.0))
    assert asyncio.run(second.tick(now=100.0)) is None  # the lease is a's
    assert first.leader and not second.leader
    # 9,000 prompt tokens queued on one prefill worker: 9 s of work against a 2 s target
    assert decision is not None and decision.kind == "switch" and decision.role == "prefill"
    assert decision.workers == ("decode-0", "decode-1")  # the fewest running requests
    text = generate_latest(registry).decode()
    assert 'planner_decisions_total{kind="switch",model_name="m",role="prefill"} 1.0' in text
    assert 'planner_targets_violated{model_name="m",target="ttft"} 1.0' in text
    assert 'planner_advised_workers{model_name="m",role="prefill"} 3.0' in text
    assert 'planner_leader{model_name="m"} 1.0' in text


def test_workers_in_their_first_steps_teach_the_planner_nothing():
    view = _view()
    for worker in [*view.prefills, *view.decodes]:
        worker.stats = EngineStats(num_running=2, decode_step_seconds=5.0,
                                   prompt_token_seconds=0.5, num_steps=WARM_STEPS - 1)  # fmt: skip
    fleet = _Fleet([_Worker(_Claim(PlannerLease()))], "a")
    loop = PlannerLoop(PlannerSettings(mode="advise"), view, fleet, TrafficWindow(), (1, 3))
    asyncio.run(loop.tick(now=1.0))
    fresh = StepModel()
    assert loop.planner.model.decode_step == fresh.decode_step
    assert loop.planner.model.token_s == fresh.token_s


def test_a_pool_of_two_coordinators_counts_the_traffic_twice():
    fleet = _Fleet([_Worker(_Claim(PlannerLease()))], "a")
    view = _view()
    view.latest_reports = [type("R", (), {"num_coordinators": 2})()]
    loop = PlannerLoop(PlannerSettings(mode="advise"), view, fleet, TrafficWindow(), (1, 3))
    for _ in range(4):
        loop.traffic.arrived(100)
    seen = []
    decide = loop.planner.decide
    loop.planner.decide = lambda workers, sample, now: (
        seen.append(sample) or decide(workers, sample, now)
    )
    asyncio.run(loop.tick(now=1.0))
    assert seen[0].arrivals == 8


def test_the_config_keys_reach_the_planner_in_their_units():
    from coordinator.config.loader import defaults

    settings = PlannerSettings(**defaults().fed(PlannerSettings))
    assert (settings.mode, settings.slo_ttft_s, settings.slo_itl_s, settings.interval_s) == (
        "off", 2.0, 0.1, 2.0,
    )  # fmt: skip


class _Switcher:
    def __init__(self) -> None:
        self.asked: list[tuple[int, str, float]] = []

    async def switch(self, instance: int, target: str, wait_s: float):
        self.asked.append((instance, target, wait_s))
        return "", None


def _elastic_view() -> _View:
    view = _view()
    for worker in [*view.prefills, *view.decodes]:
        serving = worker.role
        worker.role, worker.role_state = "elastic", RoleState(serving, 0, False, WARM_STEPS)
        worker.instance += 1 if serving == "decode" else 0
    return view


async def _tick_and_moves(loop: PlannerLoop):
    decision = await loop.tick(now=100.0)
    await asyncio.gather(*loop._moves)  # noqa: SLF001 - the moves it started
    return decision


def test_execute_switches_the_workers_it_names_and_advise_does_not():
    for mode, expected in (("advise", []), ("execute", [(1, "prefill", 0.0), (2, "prefill", 0.0)])):
        switcher = _Switcher()
        fleet = _Fleet([_Worker(_Claim(PlannerLease()))], "a")
        settings = PlannerSettings(mode=mode)
        loop = PlannerLoop(
            settings, _elastic_view(), fleet, TrafficWindow(), (1, 3), None, switcher
        )

        decision = asyncio.run(_tick_and_moves(loop))
        assert decision.kind == "switch" and decision.workers == ("elastic-1", "elastic-2")
        assert switcher.asked == expected


def test_nothing_moves_while_a_worker_switches_and_cold_roles_teach_nothing():
    view = _elastic_view()
    view.decodes[0].role_state = RoleState("decode", 1, True, 0)
    fleet = _Fleet([_Worker(_Claim(PlannerLease()))], "a")
    switcher = _Switcher()
    loop = PlannerLoop(PlannerSettings(mode="execute"), view, fleet, TrafficWindow(), (1, 3),
                       None, switcher)  # fmt: skip
    decision = asyncio.run(loop.tick(now=100.0))
    assert decision.kind == "none" and decision.reason == "a move is in progress"
    assert switcher.asked == []
    assert not loop._sample(view.decodes[0]).warm  # noqa: SLF001 - no step in its new role yet


class _Pool:
    def __init__(self, max_workers: int) -> None:
        self.fleet = _Fleet([], "a")
        self.fleet.config = type("C", (), {"max_workers": max_workers})()
        self.starting = 0
        self.asked: list[tuple[str, object]] = []

    async def grow(self, role: str) -> int:
        self.asked.append(("grow", role))
        return 9

    async def release(self, instance: int) -> str:
        self.asked.append(("release", instance))
        return ""


def test_execute_with_max_workers_starts_and_releases_workers():
    pool = _Pool(max_workers=6)
    fleet = _Fleet([_Worker(_Claim(PlannerLease()))], "a")
    loop = PlannerLoop(PlannerSettings(mode="execute"), _elastic_view(), fleet, TrafficWindow(),
                       (1, 3), None, _Switcher(), pool)  # fmt: skip
    assert loop.planner.config.max_workers == 6
    decisions = iter([
        Decision("scale_up", "no switch meets the targets", (), "prefill"),
        Decision("scale_down", "idle: back to the configured workers", ("elastic-3",), "decode"),
    ])  # fmt: skip
    seen = []

    def decide(workers, sample, now):
        seen.append(sample.starting)
        return next(decisions)

    loop.planner.decide = decide
    pool.starting = 1  # a start under way: the planner is told
    asyncio.run(_tick_and_moves(loop))
    asyncio.run(_tick_and_moves(loop))
    assert pool.asked == [("grow", "prefill"), ("release", 3)]
    assert seen == [1, 1]
    advise = PlannerLoop(PlannerSettings(mode="advise"), _elastic_view(), fleet, TrafficWindow(),
                         (1, 3), None, _Switcher(), pool)  # fmt: skip
    assert advise.pool is None and advise.planner.config.max_workers == 0
