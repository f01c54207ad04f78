"""The disaggregated cluster on a local Ray: prefill and decode actors with a real KV hand-off
over ZMQ (through ``/dev/shm``, and with the pages on the socket) and gRPC, against the colocated
``single_node`` mode. One PD cluster runs at a time: each test runs once per hand-off path."""

from __future__ import annotations

import asyncio
import random

import pytest

from coordinator.cluster import POOL_FULL, Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.request_run import RequestRun
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from engine.outputs import EngineStats
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest, Reservation, WorkerLoad

pytestmark = pytest.mark.ray

MAX_ITER_TIMES = 8
ONE_CPU = ActorResources(num_cpus=1)


def _engine(model_dir, num_blocks: int = 128) -> EngineConfig:
    return EngineConfig(
        model_path=str(model_dir),
        device="cpu",
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_iter_times=MAX_ITER_TIMES, max_prefill_tokens=16),
    )


def _cluster(
    model_dir, engine: EngineConfig | None = None, kv: dict | None = None, **overrides
) -> Cluster:
    config = ClusterConfig(
        engine=engine or _engine(model_dir),
        prefill_resources=ONE_CPU,
        decode_resources=ONE_CPU,
        colocated_resources=ONE_CPU,
        kv=KVTransferConfig(transfer_timeout_s=5.0, **(kv or {})),
        **overrides,
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    return cluster


# a PD cluster's hand-off settings, and the path its pages must take; the socket paths run
# encrypted, as between hosts (credentials made by the cluster, handed to its actors)
ENCRYPTED = {"encryption": "on"}
HANDOFFS = {
    "zmq_shm": ({"transport": "zmq"}, "shared_memory"),
    "zmq_frames_curve": ({"transport": "zmq", "shared_memory": False, **ENCRYPTED}, "frames"),
    "grpc_tls": ({"transport": "grpc", **ENCRYPTED}, "chunks"),
}


@pytest.fixture(scope="module")
def single_node(ray_session, tiny_model_dir):
    cluster = _cluster(tiny_model_dir, deploy_mode="single_node")
    yield cluster
    cluster.fleet.shutdown()


@pytest.fixture(scope="module", params=list(HANDOFFS))
def handoff(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def pd(handoff, ray_session, tiny_model_dir):
    """The pd_separate cluster of ``handoff``: one at a time, its tests run before the next's."""
    cluster = _cluster(tiny_model_dir, kv=HANDOFFS[handoff][0])
    yield cluster
    cluster.fleet.shutdown()


async def _collect(cluster, request_id, prompt, params):
    return [
        event async for event in cluster.generate(GenerationRequest(request_id, prompt, params))
    ]


async def _all(events):
    return [event async for event in events]


def _run(cluster, prompts, params, prefix):
    async def all_of_them():
        return await asyncio.gather(
            *[
                _collect(cluster, f"{prefix}-{i}", prompt, p)
                for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
            ]
        )

    return asyncio.run(all_of_them())


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3], list(range(50, 57))]
PARAMS = [
    SamplingParams(max_new_tokens=8, ignore_eos=True),
    SamplingParams(max_new_tokens=8, ignore_eos=True),
    SamplingParams(
        max_new_tokens=8, do_sample=True, temperature=1.2, top_p=0.9, seed=5, ignore_eos=True
    ),
    SamplingParams(max_new_tokens=6, do_sample=True, top_k=30, seed=77, ignore_eos=True),
]


def _handoffs_by_path(ray_session, cluster) -> dict[str, int]:
    return ray_session.get(cluster.fleet.prefills[0].num_handoffs_by_path.remote())


def test_pd_output_is_token_identical_to_single_node(pd, single_node, handoff, ray_session):
    path = HANDOFFS[handoff][1]
    before = _handoffs_by_path(ray_session, pd)
    timed: list[tuple[str, float, float]] = []  # (role, queued, prefill) of each prompt
    pd.on_prefilled = single_node.on_prefilled = lambda *timing: timed.append(timing)
    try:
        pd_runs = _run(pd, PROMPTS, PARAMS, f"pd-{handoff}")
        single = _run(single_node, PROMPTS, PARAMS, f"single-{handoff}")
    finally:
        pd.on_prefilled = single_node.on_prefilled = None
    # each prompt timed once, by the engine that computed it
    assert [role for role, _, _ in timed] == ["prefill"] * len(PROMPTS) + ["colocated"] * len(
        PROMPTS
    )
    assert all(queued >= 0 and prefill > 0 for _, queued, prefill in timed)
    after = _handoffs_by_path(ray_session, pd)
    assert set(after) == {path}  # every hand-off so far took the configured path
    assert after[path] - before.get(path, 0) == len(PROMPTS)
    for pd_events, single_events in zip(pd_runs, single, strict=True):
        assert pd_events[-1].error is None
        assert [e.token_id for e in pd_events] == [e.token_id for e in single_events]
        assert "".join(e.text for e in pd_events) == "".join(e.text for e in single_events)
        assert pd_events[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize(
    "max_new_tokens, pd_tokens, single_tokens",
    [
        (3, 3, 3),
        (MAX_ITER_TIMES, MAX_ITER_TIMES, MAX_ITER_TIMES),
        (50, MAX_ITER_TIMES + 1, MAX_ITER_TIMES),
        (1, 1, 1),
    ],
)
def test_pd_token_accounting(pd, single_node, handoff, max_new_tokens, pd_tokens, single_tokens):
    params = [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)]
    prefix = f"acct-{handoff}-{max_new_tokens}"
    split = _run(pd, [[5, 6, 7]], params, f"{prefix}-pd")[0]
    single = _run(single_node, [[5, 6, 7]], params, f"{prefix}-single")[0]
    assert len(split) == split[-1].num_output_tokens == pd_tokens
    assert len(single) == single[-1].num_output_tokens == single_tokens
    assert split[-1].finish_reason == single[-1].finish_reason == FinishReason.LENGTH


def test_a_shared_prefix_moves_only_new_blocks_and_answers_as_single_node(pd, single_node, handoff):
    offset = 50 * list(HANDOFFS).index(handoff)  # a prefix no earlier test sent to this pair
    base = list(range(100 + offset, 140 + offset))  # 40 tokens: ten blocks of 4
    prompts = [[*base, 1], [*base, 1, 2, 3, 4, 5]]
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)]
    moved: list[int] = []
    pd.on_handoff = lambda num_bytes, seconds, path: moved.append(num_bytes)
    try:
        runs = [_run(pd, [p], params, f"shared-{handoff}-{i}")[0] for i, p in enumerate(prompts)]
    finally:
        pd.on_handoff = None
    block_bytes = moved[0] // 11  # 41 prompt tokens: every one of eleven blocks moved
    assert moved == [11 * block_bytes, 2 * block_bytes]  # the decode worker held ten of twelve
    assert runs[1][0].num_cached_tokens == 40  # the prefill worker computed 5 of 45 tokens
    single = [
        _run(single_node, [p], params, f"shared-single-{handoff}-{i}")[0]
        for i, p in enumerate(prompts)
    ]
    for pd_events, single_events in zip(runs, single, strict=True):
        assert [e.token_id for e in pd_events] == [e.token_id for e in single_events]


def test_a_request_prefilled_on_the_decode_worker_answers_as_single_node(
    pd, single_node, handoff, ray_session
):
    """No hand-off at all: the decode worker computes the prompt in its own batch. Tokens,
    text and the disaggregated output limit are the same as through a prefill worker."""

    async def local(request_id: str, prompt: list[int], params: SamplingParams):
        request = GenerationRequest(request_id, prompt, params)
        return [event async for event in pd.generate(request, prefill=None, decode=0)]

    async def all_of_them():
        return await asyncio.gather(
            *[
                local(f"local-{handoff}-{i}", prompt, p)
                for i, (prompt, p) in enumerate(zip(PROMPTS, PARAMS, strict=True))
            ]
        )

    before = _handoffs_by_path(ray_session, pd)
    roles: list[str] = []
    pd.on_prefilled = lambda role, queued, prefill: roles.append(role)
    try:
        runs = asyncio.run(all_of_them())
    finally:
        pd.on_prefilled = None
    assert roles == ["decode"] * len(PROMPTS)  # timed on the engine that computed them
    assert _handoffs_by_path(ray_session, pd) == before  # no page moved
    single = _run(single_node, PROMPTS, PARAMS, f"local-single-{handoff}")
    for local_events, single_events in zip(runs, single, strict=True):
        assert local_events[-1].error is None
        assert [e.token_id for e in local_events] == [e.token_id for e in single_events]
        assert "".join(e.text for e in local_events) == "".join(e.text for e in single_events)
    long = SamplingParams(max_new_tokens=50, ignore_eos=True)
    events = asyncio.run(local(f"local-limit-{handoff}", [5, 6, 7], long))
    assert len(events) == events[-1].num_output_tokens == MAX_ITER_TIMES + 1  # as disaggregated
    _assert_idle(pd)


async def _route_and_run(pd, router, prompts, params, handoff, queued) -> tuple[list, list]:
    """Route the two queueing prompts, note both counts of the prefill queue in ``queued``, route
    the short and the longer one, then run all four on their routes; the routes and the events."""
    queueing, (short, longer) = prompts[:2], prompts[2:]
    await router.view.refresh()
    routes = [router.choose(prompt) for prompt in queueing]  # as the coordinator does
    (worker,) = router.view.prefills
    queued.append((worker.stats.num_prompt_tokens_to_compute, worker.prefill_cost))
    routes += [router.choose(short), router.choose(longer)]
    runs = await asyncio.gather(
        *[
            _collect_on(pd, route, f"adaptive-{handoff}-{i}", prompt, p)
            for i, (route, prompt, p) in enumerate(zip(routes, prompts, params, strict=True))
        ]
    )
    return routes, runs


async def _collect_on(pd, route, request_id, prompt, p) -> list:
    """The events of one request generated on the given (prefill, decode) route."""
    request = GenerationRequest(request_id, prompt, p)
    return [e async for e in pd.generate(request, prefill=route[0], decode=route[1])]


def _assert_the_same_tokens_as_single_node(runs, single) -> None:
    """Every routed answer finished without an error, token for token as ``single_node``'s."""
    for routed_events, single_events in zip(runs, single, strict=True):
        assert routed_events[-1].error is None
        assert [e.token_id for e in routed_events] == [e.token_id for e in single_events]


def test_past_the_prompt_tokens_routed_to_prefill_short_prompts_run_locally_long_ones_hand_off(
    pd, single_node, handoff, ray_session
):
    """The router's adaptive rule on the real cluster: two long prompts routed to the prefill
    worker take the router's count of the prompt tokens it sent there since the last poll (the
    queue it weighs) past ``local_prefill_queue_tokens``, while the worker itself still reports
    an empty queue; a short prompt is then prefilled on the decode worker, one longer than that
    queue still goes to the prefill worker. Every answer matches ``single_node`` token for
    token, and no block is left held on either worker."""
    routing = RoutingConfig(
        block_size=4, prefix_routing=False, local_prefill_tokens=8, local_prefill_queue_tokens=40
    )
    router = Router(pd.fleet, routing=routing)
    queueing = [list(range(100, 130)), list(range(200, 230))]  # 60 tokens routed
    short, longer = [7, 8, 9, 10, 11], list(range(300, 370))  # 5 tokens; 70, over the queue
    prompts = [*queueing, short, longer]
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * len(prompts)
    queued: list[tuple[int, float]] = []  # (the worker's queue at the poll, the router's)
    before = sum(_handoffs_by_path(ray_session, pd).values())
    roles: list[str] = []
    pd.on_prefilled = lambda role, queued, prefill: roles.append(role)
    try:
        routes, runs = asyncio.run(_route_and_run(pd, router, prompts, params, handoff, queued))
    finally:
        pd.on_prefilled = None
    assert queued == [(0, 60)]  # the rule weighed what the router sent, not a reported queue
    assert routes == [(0, 0), (0, 0), (None, 0), (0, 0)]
    assert sorted(roles) == ["decode", "prefill", "prefill", "prefill"]
    assert sum(_handoffs_by_path(ray_session, pd).values()) == before + 3  # the local one: none
    single = _run(single_node, prompts, params, f"adaptive-single-{handoff}")
    _assert_the_same_tokens_as_single_node(runs, single)
    _assert_idle(pd)


def test_prefill_and_decode_each_own_a_core(pd, ray_session):
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to pin apart")
    prefill = ray_session.get(pd.fleet.prefills[0].ready.remote()).cpus
    decode = ray_session.get(pd.fleet.decodes[0].ready.remote()).cpus
    assert len(prefill) == len(decode) == 1 and prefill != decode


def test_loads_report_every_worker(pd):
    loads = asyncio.run(pd.fleet.loads())
    assert all(isinstance(load, WorkerLoad) for load in loads)  # typed across Ray
    assert all(isinstance(load.stats, EngineStats) and load.pid > 0 for load in loads)
    assert sorted(load.role for load in loads) == ["decode", "prefill"]
    # each worker's identity, as its ready answered at start (typed across Ray too)
    assert {(i.role, i.pid) for i in pd.fleet.identities.values()} == {
        (load.role, load.pid) for load in loads
    }
    stats = [load.stats for load in loads]
    assert all(s.num_free_blocks == s.num_total_blocks == 128 for s in stats)


def _assert_idle(cluster) -> None:
    async def settled():
        for _ in range(100):
            stats = [load.stats for load in await cluster.fleet.loads()]
            if all(
                s.num_free_blocks == s.num_total_blocks and not s.num_reserved and not s.num_held
                for s in stats
            ):
                return stats
            await asyncio.sleep(0.1)
        return [load.stats for load in await cluster.fleet.loads()]

    for load in asyncio.run(settled()):
        assert load.num_free_blocks == load.num_total_blocks, load
        assert load.num_reserved == load.num_held == load.num_running == 0, load


def test_200_mixed_requests_with_aborts_leak_no_block(pd, handoff):
    rng = random.Random(3)

    async def one(i: int):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
        params = SamplingParams(
            max_new_tokens=rng.randrange(1, 12), ignore_eos=True, do_sample=rng.random() < 0.5
        )
        run = RequestRun(GenerationRequest(f"leak-{handoff}-{i}", prompt, params))
        run.route_to((0, 0))
        events = _all(pd.stream(run))
        if (
            rng.random() < 0.4
        ):  # abort at a random moment: queued, in prefill, in transfer, decoding
            task = asyncio.ensure_future(events)
            await asyncio.sleep(rng.random() * 0.05)
            await pd.abort(run)
            return await task
        return await events

    async def all_of_them():
        return await asyncio.gather(*[one(i) for i in range(200)])

    results = asyncio.run(all_of_them())
    assert all(events and events[-1].finished for events in results)
    reasons = {events[-1].finish_reason for events in results}
    assert FinishReason.LENGTH in reasons and FinishReason.ABORT in reasons
    _assert_idle(pd)


def test_full_decode_worker_refuses_with_a_reason(ray_session, tiny_model_dir):
    config = ClusterConfig(
        engine=_engine(tiny_model_dir, num_blocks=4),
        prefill_resources=ONE_CPU,
        decode_resources=ONE_CPU,
        reservation_wait_s=0.3,
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    try:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        decode, owner = cluster.fleet.decodes[0], cluster.fleet.coordinator_id
        stranger = ray_session.get(decode.reserve.remote(GenerationRequest("s", [5], params)))
        channel = cluster.fleet.identities[("decode", 0)].token_channel
        assert stranger == Reservation.unattached(channel)  # its events would reach no one

        async def reserve(request_id: str, prompt) -> Reservation:
            await cluster.fleet.attach(("decode", 0))
            request = GenerationRequest(request_id, prompt, params, owner=owner)
            return await decode.reserve.remote(request, 0.1)

        hog = asyncio.run(reserve("hog", range(3, 15)))
        assert hog.granted  # 13 tokens = all 4 blocks of the decode worker
        assert isinstance(hog, Reservation) and hog.endpoint.startswith("tcp://")
        refused = asyncio.run(reserve("other", [5, 6, 7]))
        assert refused == Reservation.no_room("decode cache full: 0 of 4 blocks free, 1 needed")
        events = asyncio.run(_collect(cluster, "refused", list(range(3, 12)), params))
        assert events[-1].finish_reason == FinishReason.ERROR
        assert events[-1].cause == POOL_FULL  # the service answers 429: the pool is full
        assert "decode cache full: 0 of 4 blocks free, 3 needed" in events[-1].error
        ray_session.get(cluster.fleet.decodes[0].abort.remote("hog"))
        _assert_idle(cluster)
    finally:
        cluster.fleet.shutdown()
