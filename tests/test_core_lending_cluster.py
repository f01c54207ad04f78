"""``share_idle_cores`` on a local Ray: each worker is pinned to its own core and the other
role's, borrows while the other is idle, streams what ``single_node`` streams, frees every block,
and its files go when the cluster does."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from tests.test_cluster_pd import PARAMS, PROMPTS, _assert_idle, _cluster, _engine, _run
from workers import core_lending

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def shared(ray_session, tiny_model_dir):
    cluster = _cluster(
        tiny_model_dir,
        engine=_long_engine(tiny_model_dir),
        share_idle_cores=True,
    )
    assert len(_files(cluster)) == 2
    yield cluster
    cluster.shutdown()
    assert _files(cluster) == []  # the files go with the cluster


@pytest.fixture(scope="module")
def colocated(ray_session, tiny_model_dir):
    cluster = _cluster(
        tiny_model_dir, engine=_long_engine(tiny_model_dir), deploy_mode="single_node"
    )
    yield cluster
    cluster.shutdown()


def _long_engine(model_dir):
    """Room for a stream long enough to be running when a long prompt comes."""
    engine = _engine(model_dir, num_blocks=256)
    return replace(engine, scheduler=replace(engine.scheduler, max_iter_times=STREAM_TOKENS))


STREAM_TOKENS = 256


def _same_as_single_node(shared, runs: list, single: list) -> dict:
    """Every request ended well with ``single_node``'s tokens, and ``shared`` freed every block;
    its workers' loads by role."""
    for events, single_events in zip(runs, single, strict=True):
        assert events[-1].error is None
        assert [e.token_id for e in events] == [e.token_id for e in single_events]
    _assert_idle(shared)
    return {load.role: load for load in asyncio.run(shared.loads())}


def _files(cluster) -> list[Path]:
    return sorted(core_lending.SHM_DIR.glob(f"pdserve-{cluster._id}-*.cores"))


def test_outputs_match_single_node_and_both_roles_borrow(shared, colocated):
    before = {load.role: load.num_borrowing_steps for load in asyncio.run(shared.loads())}
    # a stream long enough to outlive every prefill: its last steps find the prefill worker
    # idle however fast the machine (eight-token answers alone may all end while it is busy)
    prompts = [*PROMPTS, [5, 6, 7]]
    params = [*PARAMS, SamplingParams(max_new_tokens=STREAM_TOKENS, ignore_eos=True)]
    loads = _same_as_single_node(
        shared, _run(shared, prompts, params, "shared"), _run(colocated, prompts, params, "s")
    )
    # the first prefill step found the decode worker idle, and the last decode steps the
    # prefill worker; each runs its own thread plus the one it borrows
    assert loads["prefill"].num_borrowing_steps > before["prefill"]
    assert loads["decode"].num_borrowing_steps > before["decode"]
    assert {load.threads for load in loads.values()} <= {1, 2}


def test_each_worker_may_run_on_both_cores_and_publishes_its_idleness(shared, ray_session):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to share")
    for actor in (shared.prefills[0], shared.decodes[0]):
        assert ray_session.get(actor.ready.remote())["cpus"] == cores[:2]
    _assert_idle(shared)
    files = _files(shared)
    assert [f.name.split("-")[2] for f in files] == ["decode", "prefill"]
    asyncio.run(asyncio.sleep(0.2))  # the engine loops note their idleness within 50 ms
    assert all(f.read_bytes()[:2] == bytes((1, 1)) for f in files)  # idle, one thread each
