"""Peer prefix pulls on a local Ray (``kv_peer_pull``): a conversation's second turn on a
prefill worker takes the first turn's prompt and answer from the decode worker that decoded it,
over the KV plane (ZMQ, or gRPC with TLS and the cluster's credentials), and answers token for
token as an engine computing it all; a pull from a worker that holds nothing fails alone (the
prompt computes it) and frees every block it set aside."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.pool.prefix_pull import PullOutcome
from coordinator.request_run import RequestRun
from coordinator.routing.pull_cost import PullPlan
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from workers.contracts import GenerationRequest

pytestmark = pytest.mark.ray

ONE_CPU = ActorResources(num_cpus=1)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
FIRST = list(range(30, 51))  # 21 tokens


def _cluster(model_dir, transport: str, encryption: str) -> Cluster:
    engine = EngineConfig(
        model_path=str(model_dir), device="cpu", cache=CacheConfig(block_size=4, num_blocks=128)
    )
    config = ClusterConfig(
        engine=engine,
        deploy_mode="pd_separate",
        prefill_resources=ONE_CPU,
        decode_resources=ONE_CPU,
        kv=KVTransferConfig(transport=transport, encryption=encryption, peer_pull=True),
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    return cluster


def _turn(cluster: Cluster, request_id: str, tokens: list[int], pull: PullPlan | None) -> list:
    async def run() -> list:
        state = RequestRun(GenerationRequest(request_id, tokens, GREEDY))
        state.route_to((0, 0))
        state.pull = pull
        return [event async for event in cluster.stream(state)]

    return asyncio.run(run())


def _outputs(events: list) -> list[int]:
    assert events[-1].error is None and events[-1].finish_reason == FinishReason.LENGTH
    return [e.token_id for e in events if e.token_id is not None]


def _settled_loads(cluster: Cluster, timeout_s: float = 5.0) -> dict:
    """Each role's stats once the prefill worker holds no request: it releases a prompt's blocks
    when the decode side's acknowledgement reaches its engine thread, which may come after the
    decode side's last token (or as they are at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {load.role: load.stats for load in asyncio.run(cluster.fleet.loads())}
        if loads["prefill"].num_held == 0 or time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


@pytest.mark.parametrize(("transport", "encryption"), [("zmq", "auto"), ("grpc", "on")])
def test_a_second_turn_pulls_the_first_from_the_decode_worker(
    ray_session, tiny_model_dir, tiny_loaded, transport, encryption
):
    cluster = _cluster(tiny_model_dir, transport, encryption)
    outcomes: list[PullOutcome] = []
    cluster.on_pull = outcomes.append
    try:
        answer = _outputs(_turn(cluster, "turn-1", FIRST, None))
        second = [*FIRST, *answer, 7, 8, 9, 10, 11]  # 38 tokens: the first 32 decoded already
        history_blocks = len(FIRST + answer) // 4  # 8 blocks, on the decode worker
        events = _turn(cluster, "turn-2", second, PullPlan(("decode", 0), history_blocks))
        got = _outputs(events)
        stranger = list(range(200, 241))
        lost = _outputs(_turn(cluster, "stranger", stranger, PullPlan(("decode", 0), 10)))
        loads = _settled_loads(cluster)
    finally:
        cluster.fleet.shutdown()
    # the prefill worker held the first 5 blocks (the first prompt): 3 came from the decode side
    ok, failed = outcomes
    assert ok.ok and (ok.source_role, ok.num_asked, ok.num_blocks) == ("decode", 3, 3)
    assert ok.num_bytes > 0 and ok.error is None
    assert events[-1].num_cached_tokens == 32
    assert not failed.ok and failed.num_asked == 10 and "holds none" in (failed.error or "")
    assert loads["prefill"].kv_pulled_blocks == 3 and loads["prefill"].kv_pulls_failed == 1
    assert loads["decode"].kv_exported_blocks == 3
    assert loads["prefill"].num_free_blocks == loads["prefill"].num_total_blocks
    engine = make_engine(tiny_loaded, block_size=4)
    assert got == engine.generate([second], GREEDY)[0]
    assert lost == engine.generate([stranger], GREEDY)[0]
