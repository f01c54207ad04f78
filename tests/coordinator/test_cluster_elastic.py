"""Elastic workers on a real pool (local Ray, tiny model, 4 workers): requests decode while
workers switch roles under them (the management call's path, ``RoleSwitcher``), and while a
view of the roles is stale (another coordinator's before its next poll), and while another
worker is killed mid-switch, through twenty switches in a row, and while the pool grows by a
worker and releases one with requests on it; one planner in ``execute`` mode moves workers to
prefill when prompts queue, back to the configured split when traffic stops, and none under a
steady load. Every request finishes, token-identical to a run without switches, none failed,
the handed-on ones counted apart, and no block stays reserved."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest
from prometheus_client import generate_latest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.inference import InferenceService, Timeouts
from coordinator.metrics import Metrics
from coordinator.planner import PlannerSettings
from coordinator.planner.loop import PlannerLoop
from coordinator.planner.traffic import TrafficWindow
from coordinator.pool.pool_size import PoolSize
from coordinator.pool.role_switch import RoleSwitcher
from coordinator.router import Router
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest

pytestmark = pytest.mark.ray

ONE_CPU = ActorResources(num_cpus=1)
MIGRATIONS = "request_role_switch_migrations_total{"
PARAMS = (
    SamplingParams(max_new_tokens=600, ignore_eos=True),
    SamplingParams(max_new_tokens=600, do_sample=True, top_k=30, seed=7, ignore_eos=True),
)


@pytest.fixture(scope="module")
def elastic(ray_session, tiny_model_dir):
    engine = EngineConfig(model_path=str(tiny_model_dir), device="cpu", batch_invariant=True,
                          cache=CacheConfig(block_size=4, num_blocks=512))  # fmt: skip
    config = ClusterConfig(
        engine=engine, elastic_roles=True, num_prefill=1, num_decode=3,
        prefill_resources=ONE_CPU, decode_resources=ONE_CPU,
        kv=KVTransferConfig(transfer_timeout_s=5.0, reservation_timeout_s=5.0),
    )  # fmt: skip
    cluster = Cluster(config)
    cluster.fleet.start()
    yield cluster
    cluster.fleet.shutdown()


def _requests(tag: str) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}-{i}", [5 + i, 6, 7, 8, 9 + i % 3] * (1 + i % 4), PARAMS[i % 2])
        for i in range(12)
    ]


async def _run(
    service: InferenceService,
    requests: list[GenerationRequest],
    started: asyncio.Event | None = None,
) -> dict[str, list]:
    """Every request's events; ``started`` is set once each one has streamed a token."""
    streaming: set[str] = set()

    async def one(request: GenerationRequest) -> list:
        events = []
        async for event in service.generate(request):
            events.append(event)
            streaming.add(request.request_id)
            if started is not None and len(streaming) == len(requests):
                started.set()
        return events

    outputs = await asyncio.gather(*map(one, requests))
    return {request.request_id: events for request, events in zip(requests, outputs, strict=True)}


def _tokens(events: list) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


async def _service(cluster: Cluster) -> tuple[InferenceService, Router, Metrics]:
    router = Router(cluster.fleet, poll_interval_s=0.1)
    await router.view.refresh()
    router.view.start()
    metrics = Metrics("m")
    return InferenceService(cluster, router, 256, 2, Timeouts(), metrics), router, metrics


def test_requests_move_token_identically_while_workers_switch_roles(elastic):
    async def scenario():
        service, router, metrics = await _service(elastic)
        switcher = RoleSwitcher(router.view, metrics)
        try:
            reference = await _run(service, _requests("fixed"))
            started = asyncio.Event()
            moving = asyncio.ensure_future(_run(service, _requests("moving"), started))
            await asyncio.wait_for(started.wait(), 60)  # every request decoding somewhere
            answers = []
            # a decode worker to prefill (its requests move), the prefill worker to decode,
            # then back, all while the requests decode
            for instance, role in ((1, "prefill"), (0, "decode"), (1, "decode"), (0, "prefill")):
                answers.append(await switcher.switch(instance, role, 30.0))
            moved = await moving
            handed_on = _count(generate_latest(metrics.registry).decode(), MIGRATIONS)
            # a view gone stale (another coordinator's, before its next poll): worker 1 looks
            # like the prefill worker it was at epoch 1; its refusals send the requests on
            fleet = elastic.fleet
            fleet.roles[1], fleet.roles[0] = answers[0][1], replace(answers[1][1], epoch=0)
            router.view.sort_roles()
            stale = await _run(service, _requests("stale"))
            loads = await fleet.loads()
            return reference, moved, stale, answers, metrics, loads, handed_on
        finally:
            await router.view.stop()

    reference, moved, stale, answers, metrics, loads, handed_on = asyncio.run(scenario())
    assert [refusal for refusal, _ in answers] == ["", "", "", ""]
    assert [state.epoch for _, state in answers] == [1, 1, 2, 2]
    assert all(not state.switching for _, state in answers)
    for i in range(12):
        fixed = _tokens(reference[f"fixed-{i}"])
        for tag, run in (("moving", moved), ("stale", stale)):
            events = run[f"{tag}-{i}"]
            assert events[-1].finish_reason == FinishReason.LENGTH, events[-1]
            assert _tokens(events) == fixed, f"{tag} request {i} changed tokens"
    text = generate_latest(metrics.registry).decode()
    assert handed_on >= 1  # requests decoding on the worker that left decode
    assert _count(text, MIGRATIONS) > handed_on  # and those refused by the stale view
    assert _count(text, 'worker_role_switches_total{model_name="m",outcome="accepted"') == 4
    assert _count(text, "request_migrations_total{") == 0  # none of them a failure
    for load in loads:  # nothing left reserved or running anywhere
        assert load.stats.num_running + load.stats.num_reserved + load.stats.num_held == 0
        assert load.num_open_streams == 0


def _count(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix))  # fmt: skip


def test_twenty_switches_under_load_fail_no_request(elastic):
    """Waves of requests run while the workers switch roles one after another (always one
    prefill and one decode worker left): none fails, every one token-identical."""

    async def scenario():
        service, router, metrics = await _service(elastic)
        switcher, fleet, stop = RoleSwitcher(router.view, metrics), elastic.fleet, asyncio.Event()
        try:
            reference = await _run(service, _requests("calm"))

            async def waves() -> list[dict[str, list]]:
                runs = []
                while not stop.is_set():
                    runs.append(await _run(service, _requests(f"wave{len(runs)}")))
                return runs

            load = asyncio.ensure_future(waves())
            answers = []
            while len(answers) < 20:
                await asyncio.sleep(0.05)
                roles = {n: state.serving for n, state in sorted(fleet.roles.items())}
                prefills = [n for n, role in roles.items() if role == "prefill"]
                decodes = [n for n, role in roles.items() if role == "decode"]
                # alternately a decode worker to prefill and the oldest prefill one to decode
                instance, target = (
                    (decodes[0], "prefill") if len(answers) % 2 == 0 else (prefills[0], "decode")
                )
                answers.append(await switcher.switch(instance, target, 30.0))
            stop.set()
            return reference, await load, answers, metrics
        finally:
            await router.view.stop()

    reference, waves, answers, metrics = asyncio.run(scenario())
    assert [refusal for refusal, _ in answers] == [""] * 20
    assert waves, "no wave ran while the workers switched"
    for n, wave in enumerate(waves):
        for i in range(12):
            events = wave[f"wave{n}-{i}"]
            assert events[-1].finish_reason == FinishReason.LENGTH, events[-1]
            assert _tokens(events) == _tokens(reference[f"calm-{i}"]), f"wave {n} request {i}"
    text = generate_latest(metrics.registry).decode()
    assert _count(text, "request_failed_total{") == 0
    assert _count(text, MIGRATIONS) >= 1


def test_the_planner_follows_the_mix_and_holds_still(elastic):
    """``execute``, one planner throughout: floods of long prompts violate the TTFT target and
    it moves decode workers to prefill; with no traffic the roles go back to the configured
    split; under a steady load that keeps both targets nothing moves. Every request finishes
    token-identical to the same request on the fixed split afterwards, none failed."""

    async def scenario():
        service, router, metrics = await _service(elastic)
        switcher, fleet = RoleSwitcher(router.view, metrics), elastic.fleet
        try:
            await _set_split(switcher, fleet, prefills=1)  # the configured split
            await _run(service, _steady(0))  # every worker past its cold steps
            settings = PlannerSettings(mode="execute", slo_ttft_ms=100, slo_itl_ms=60_000,
                                       interval_ms=400)  # fmt: skip
            traffic = TrafficWindow()
            service.traffic = traffic
            loop = PlannerLoop(settings, router.view, fleet, traffic, (1, 3), None, switcher)
            loop.planner.config = replace(loop.planner.config, scale_down_after_s=1.0)
            decisions = _record(loop)
            planning = asyncio.ensure_future(loop.run())
            sent, runs, splits = [], [], []

            async def send(requests: list[GenerationRequest]) -> None:
                sent.append(requests)
                runs.append(await _run(service, requests))

            for wave in range(1, 8):  # prompts queue: decode workers to prefill
                await send(_floods(wave))
                if _split(fleet) != (1, 3):
                    break
            await _until(lambda: not any(s.switching for s in fleet.roles.values()), 30)
            splits.append(_split(fleet))
            await _until(lambda: _split(fleet) == (1, 3), 30)  # no traffic: back to (1, 3)
            splits.append(_split(fleet))
            settled = len(decisions)
            while len(decisions) < settled + 10:  # a steady load within both targets
                await send(_steady(len(runs)))
            splits.append(_split(fleet))
            planning.cancel()
            await asyncio.gather(planning, *loop._moves, return_exceptions=True)  # noqa: SLF001
            service.traffic = None
            fixed = {}
            for requests in sent:  # the same requests again, on the configured split
                fixed |= await _run(service, [replace(r, request_id=f"fixed-{r.request_id}")
                                              for r in requests])  # fmt: skip
            return fixed, runs, splits, decisions[settled:], metrics
        finally:
            service.traffic = None
            await router.view.stop()

    fixed, runs, splits, after_settling, metrics = asyncio.run(scenario())
    assert splits[0][0] >= 2 and splits[1:] == [(1, 3), (1, 3)], splits
    assert [d.reason for d in after_settling if d.kind != "none"] == []
    for run in runs:
        for key, events in run.items():
            assert events[-1].finish_reason == FinishReason.LENGTH, (key, events[-1])
            assert _tokens(events) == _tokens(fixed[f"fixed-{key}"]), f"{key} changed tokens"
    text = generate_latest(metrics.registry).decode()
    assert _count(text, "request_failed_total{") == 0
    assert _count(text, 'worker_role_switches_total{model_name="m",outcome="accepted"') >= 2


def _floods(wave: int) -> list[GenerationRequest]:
    """Long prompts, all at once (the same in every wave but the first token, kept out of the
    prefix caches by it): they queue at prefill."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    return [GenerationRequest(f"flood{wave}-{i}", [3 + wave, *[4 + i % 40] * 900], params)
            for i in range(24)]  # fmt: skip


def _steady(wave: int) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    return [GenerationRequest(f"steady{wave}-{i}", [3, 5 + i, 6, 7], params)
            for i in range(4)]  # fmt: skip


def _split(fleet) -> tuple[int, int]:
    roles = [state.serving for state in fleet.roles.values()]
    return roles.count("prefill"), roles.count("decode")


def _record(loop: PlannerLoop) -> list:
    """Every decision ``loop``'s planner takes, in order."""
    decide, decisions = loop.planner.decide, []

    def recorded(*args):
        decisions.append(decide(*args))
        return decisions[-1]

    loop.planner.decide = recorded
    return decisions


async def _until(condition, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


async def _set_split(switcher: RoleSwitcher, fleet, prefills: int) -> None:
    """Workers 0..prefills-1 to prefill, the others to decode."""
    for instance, state in sorted(fleet.roles.items()):
        target = "prefill" if instance < prefills else "decode"
        if state.serving != target:
            assert (await switcher.switch(instance, target, 30.0))[0] == ""


def test_a_switch_while_another_worker_is_killed_loses_no_request(elastic):
    async def scenario():
        service, router, metrics = await _service(elastic)
        switcher = RoleSwitcher(router.view, metrics)
        try:
            await _set_split(switcher, elastic.fleet, prefills=1)
            epoch = elastic.fleet.roles[3].epoch
            reference = await _run(service, _requests("ref"))
            started = asyncio.Event()
            moving = asyncio.ensure_future(_run(service, _requests("hit"), started))
            await asyncio.wait_for(started.wait(), 60)
            switching = asyncio.ensure_future(switcher.switch(3, "prefill", 30.0))
            victim = (await elastic.fleet.worker("elastic", 2).ready.remote()).pid
            os.kill(victim, signal.SIGKILL)
            hit = await asyncio.wait_for(moving, 120)
            return reference, hit, await switching, metrics, epoch
        finally:
            await router.view.stop()

    reference, hit, (refusal, state), metrics, epoch = asyncio.run(scenario())
    assert refusal == "" and (state.serving, state.epoch) == ("prefill", epoch + 1)
    for i in range(12):
        events = hit[f"hit-{i}"]
        assert events[-1].finish_reason == FinishReason.LENGTH, events[-1]
        assert _tokens(events) == _tokens(reference[f"ref-{i}"]), f"request {i} changed tokens"
    text = generate_latest(metrics.registry).decode()
    assert _count(text, "request_failed_total{") == 0
    assert _count(text, 'request_migrations_total{model_name="m",reason="worker_lost"}') >= 1


def test_the_pool_grows_by_a_worker_and_releases_one_with_requests_on_it(
    ray_session, tiny_model_dir
):
    engine = EngineConfig(model_path=str(tiny_model_dir), device="cpu", batch_invariant=True,
                          cache=CacheConfig(block_size=4, num_blocks=512))  # fmt: skip
    config = ClusterConfig(
        engine=engine, elastic_roles=True, num_prefill=1, num_decode=1, max_workers=3,
        prefill_resources=ONE_CPU, decode_resources=ONE_CPU,
    )  # fmt: skip
    cluster = Cluster(config)
    cluster.fleet.start()

    async def scenario():
        service, router, metrics = await _service(cluster)
        pool = PoolSize(cluster.fleet, router.view)
        try:
            reference = await _run(service, _requests("before")[:6])
            grown = await pool.grow("decode")
            assert [s.instance for s in router.view.decodes] == [1, 2]
            with pytest.raises(ValueError, match="max_workers"):
                await pool.grow("decode")  # 3 of 3: the pool is full
            started = asyncio.Event()
            moving = asyncio.ensure_future(_run(service, _requests("grown")[:6], started))
            await asyncio.wait_for(started.wait(), 60)
            refusal = await pool.release(1)  # a decode worker with requests on it
            moved = await moving
            after = await _run(service, _requests("after")[:6])
            fleet = cluster.fleet
            with pytest.raises(IndexError, match="released"):
                fleet.worker("elastic", 1)
            assert sorted(fleet.roles) == [0, 2] and fleet.elastic[1] is None
            assert [s.instance for s in router.view.decodes] == [2]
            return reference, grown, refusal, moved, after, metrics
        finally:
            await router.view.stop()

    try:
        reference, grown, refusal, moved, after, metrics = asyncio.run(scenario())
    finally:
        cluster.fleet.shutdown()
    assert grown == 2 and refusal == ""
    for i in range(6):
        fixed = _tokens(reference[f"before-{i}"])
        for tag, run in (("grown", moved), ("after", after)):
            assert run[f"{tag}-{i}"][-1].finish_reason == FinishReason.LENGTH
            assert _tokens(run[f"{tag}-{i}"]) == fixed, f"{tag} request {i} changed tokens"
    text = generate_latest(metrics.registry).decode()
    assert _count(text, "request_failed_total{") == 0
