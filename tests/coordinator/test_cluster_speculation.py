"""Speculative decoding through prefill/decode on a local Ray: the decode worker drafts from the
tokens the hand-off brought (nothing of a draft crosses it), and the answers are token for token
those of a colocated engine that does not speculate; the worker's loads count its checks."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.cluster import Cluster
from coordinator.config.cluster import ActorResources, ClusterConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest

pytestmark = pytest.mark.ray

ONE_CPU = ActorResources(num_cpus=1)
PROMPTS = [[5, 6, 7, 8, 9] * 3, list(range(10, 30)) * 2, [11, 12, 11, 12, 13]]
PARAMS = [
    SamplingParams(max_new_tokens=24, ignore_eos=True),
    SamplingParams(max_new_tokens=24, do_sample=True, seed=5, temperature=0.8, ignore_eos=True),
    SamplingParams(max_new_tokens=16, do_sample=True, top_k=20, seed=9, ignore_eos=True),
]


def _cluster(model_dir, deploy_mode: str, method: str) -> Cluster:
    engine = EngineConfig(
        model_path=str(model_dir),
        device="cpu",
        batch_invariant=True,
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_prefill_tokens=16),
        speculative=SpeculativeConfig(method=method, min_match=1),
    )
    config = ClusterConfig(
        engine=engine,
        deploy_mode=deploy_mode,
        prefill_resources=ONE_CPU,
        decode_resources=ONE_CPU,
        colocated_resources=ONE_CPU,
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    return cluster


def _run(cluster: Cluster, prefix: str, together: bool = True) -> list[list]:
    """Every prompt's events, sent all at once (``together``) or one after another."""

    async def one(i: int) -> list:
        request = GenerationRequest(f"{prefix}-{i}", PROMPTS[i], PARAMS[i])
        return [event async for event in cluster.generate(request)]

    async def all_of_them() -> list[list]:
        if together:
            return await asyncio.gather(*[one(i) for i in range(len(PROMPTS))])
        return [await one(i) for i in range(len(PROMPTS))]

    return asyncio.run(all_of_them())


def test_pd_with_drafts_answers_as_a_colocated_engine_without(ray_session, tiny_model_dir):
    plain = _cluster(tiny_model_dir, "single_node", "off")
    try:
        expected = _run(plain, "plain")
    finally:
        plain.fleet.shutdown()
    pd = _cluster(tiny_model_dir, "pd_separate", "ngram")
    try:
        # one at a time: a request decoding alone drafts at every step (with three decoding
        # together, whether a draft pays depends on the steps' measured cost: it may not)
        got = _run(pd, "pd", together=False)
        loads = {load.role: load.stats for load in asyncio.run(pd.fleet.loads())}
    finally:
        pd.fleet.shutdown()
    for pd_events, plain_events in zip(got, expected, strict=True):
        assert pd_events[-1].error is None and pd_events[-1].finish_reason == FinishReason.LENGTH
        assert [e.token_id for e in pd_events] == [e.token_id for e in plain_events]
    decode = loads["decode"]
    assert decode.speculative_checks > 0 and decode.speculative_drafted > 0
    assert len(decode.speculative_accepted_histogram) == SpeculativeConfig().max_draft + 1
    assert loads["prefill"].speculative_checks == 0  # it stops at each prompt's first token
    assert decode.num_free_blocks == decode.num_total_blocks
