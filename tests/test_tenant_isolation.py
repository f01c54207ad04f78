"""Tenants (``http_config.api_keys`` with ``tenant_isolation``): one key's requests never hit
another key's cached prefix, in the engine, in a decode worker's reservation, and in the
router's prefix index; probed through a real HTTP server whose cluster runs real tiny engines
in-process. With isolation off, every key shares one cache as before."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from coordinator.api.app import create_predict_app
from coordinator.api.tenants import Tenants, record_tenant
from coordinator.config import defaults
from coordinator.inference import InferenceService, Timeouts
from coordinator.model_info import ModelInfo
from coordinator.request_run import RequestRun
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from coordinator.served_model import ServedModels
from coordinator.server import Coordinator
from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.conftest import make_engine
from tests.door_fakes import AZURE_CHAT, CharTokenizer, serving
from tests.test_manage_and_mtls import config_with
from tests.test_router_prefix import PROMPT_A, _poll, _queued, _router, _running
from workers.colocated import ColocatedWorker
from workers.contracts import GenerationRequest, HandoffResult, HandoffTarget

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"
PARAMS = SamplingParams(max_new_tokens=3, ignore_eos=True)
SYSTEM = list(range(20, 46))  # 26 tokens: six full blocks of 4, and two over
PROBE = "You are a helpful assistant. Q:"  # 31 characters, 31 tokens: 7 full blocks
PROBE_CACHED = 28  # what a hit on PROBE reuses: all its full blocks (the last token is computed)


def _config(model_dir) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=True)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


def _cached(engine, request_id: str, prompt: list[int], tenant: str) -> int:
    engine.add_request(engine.request(request_id, prompt, PARAMS, tenant=tenant))
    events = []
    while request_id in engine.requests:
        events += [e for e in engine.step() if e.request_id == request_id]
    return max(e.num_cached_tokens for e in events)


# ---- the edge: tenant ids --------------------------------------------------------------------


def test_a_tenant_id_is_a_keyed_hash_never_the_key():
    tenants = Tenants([KEY_A, KEY_B])
    a, b = (tenants._ids[key] for key in (KEY_A, KEY_B))
    assert a != b and len(a) == len(b) == 32
    assert KEY_A not in a and KEY_A.encode().hex() not in a
    assert Tenants([KEY_A])._ids[KEY_A] != a  # another coordinator's secret, another id
    assert (
        Tenants([KEY_A], secret=b"s" * 32)._ids[KEY_A]
        == Tenants([KEY_A], secret=b"s" * 32)._ids[KEY_A]
    )
    assert not Tenants([KEY_A, KEY_B], isolation=False) and not Tenants([])
    assert not Tenants([""])  # an empty key names no tenant


# ---- the engine and the decode worker --------------------------------------------------------


def test_a_tenant_never_hits_another_tenants_prefix_in_the_engine(tiny_loaded):
    engine = make_engine(tiny_loaded)
    assert _cached(engine, "a1", [*SYSTEM, 1], "tenant-a") == 0
    assert _cached(engine, "b1", [*SYSTEM, 2], "tenant-b") == 0  # A's six blocks: not B's
    assert _cached(engine, "a2", [*SYSTEM, 3], "tenant-a") == 24  # A's own: a hit
    assert _cached(engine, "b2", [*SYSTEM, 4], "tenant-b") == 24  # B's own, cached just now
    assert _cached(engine, "n1", [*SYSTEM, 5], "") == 0  # no tenant is a root of its own
    assert _cached(engine, "n2", [*SYSTEM, 6], "") == 24  # and shares as it always did
    engine.blocks.check_consistent()


def test_a_decode_reservation_shares_only_its_own_tenants_blocks(tiny_model_dir):
    transfer = KVTransferConfig("inprocess", transfer_timeout_s=5.0)
    prefill = PrefillWorker(_config(tiny_model_dir), transfer)
    decode = DecodeWorker(_config(tiny_model_dir), transfer)
    try:

        def handoff(request_id: str, tenant: str) -> tuple[int, int]:
            request = GenerationRequest(request_id, [*SYSTEM, 1, 2], PARAMS, tenant=tenant)
            reservation = decode.reserve(request)
            assert reservation.granted, reservation.reason
            target = HandoffTarget.from_reservation(reservation, PARAMS.max_new_tokens)
            items = list(prefill.prefill(request, target))
            assert isinstance(items[-1], HandoffResult) and items[-1].ok, items[-1]
            events = [i for i in items if isinstance(i, TokenEvent)] + list(
                decode.stream(request_id)
            )
            return reservation.num_cached_blocks, max(e.num_cached_tokens for e in events)

        assert handoff("a1", "tenant-a") == (0, 0)
        assert handoff("b1", "tenant-b") == (0, 0)  # neither side lends B what A sent
        assert handoff("a2", "tenant-a") == (6, 24)  # A's own: held on both sides
        # a migrated request keeps its tenant, and with it its own prefix
        continued = GenerationRequest("b", SYSTEM, PARAMS, tenant="tenant-b").continued(
            "b2", [1, 2]
        )
        assert continued.tenant == "tenant-b"
        assert decode.reserve(continued).num_cached_blocks == 6
        decode.abort("b2")
    finally:
        for worker in (prefill, decode):
            worker.loop.stop()
        decode.receiver.close()
        prefill.sender.close()


# ---- the router ------------------------------------------------------------------------------


def test_the_router_is_not_drawn_by_another_tenants_prefix():
    router = _router()
    assert router.choose(PROMPT_A, tenant="a") == (0, 0)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))  # busier, within the knobs
    # B's same prompt: A's history on pair 0 does not count for it; the least loaded wins
    assert router.choose(PROMPT_A, tenant="b") == (1, 1)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))
    assert router.choose(PROMPT_A, tenant="a") == (0, 0)  # A's own history still draws it
    _poll(router, prefill_1=_queued(10), decode_1=_running(2))
    assert router.choose(PROMPT_A, tenant="b") == (1, 1)  # and B's its own


def test_without_tenants_the_router_follows_any_prefix_as_before():
    router = _router()
    assert router.choose(PROMPT_A) == (0, 0)
    _poll(router, prefill_0=_queued(10), decode_0=_running(2))
    assert router.choose(PROMPT_A) == (0, 0)  # busier, but it holds the prefix


# ---- through a real HTTP server --------------------------------------------------------------


@dataclass
class _Mode:
    deploy_mode: str = "single_node"


class InProcessCluster:
    """``single_node`` with real colocated workers in this process (no Ray): what the router
    and the service ask of a cluster."""

    def __init__(self, workers: list[ColocatedWorker]) -> None:
        self.config = _Mode()
        self.prefills: list = []
        self.decodes: list = []
        self.colocated = workers

    async def loads(self):
        return [await asyncio.to_thread(w.load) for w in self.colocated]

    async def reports(self, cursors):
        """``Cluster.reports``: the workers' real load polls, prefix-cache events included."""
        return [
            await asyncio.to_thread(w.report, "tests", *cursors.get(("colocated", i), ("", -1)))
            for i, w in enumerate(self.colocated)
        ]

    async def kv_snapshot(self, role, instance):
        return await asyncio.to_thread(self.colocated[instance].kv_snapshot)

    async def kv_events(self, role, instance, epoch, seq, wait_s):
        """``Cluster.kv_events``: the worker's real long poll."""
        worker = self.colocated[instance]
        return await asyncio.to_thread(worker.kv_events, epoch, seq, wait_s)

    async def stream(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        worker = self.colocated[run.route[1]]
        events = worker.generate(run.attempt)
        while (event := await asyncio.to_thread(next, events, None)) is not None:
            yield event

    async def abort(self, run: RequestRun) -> None:
        if run.route is not None:
            await asyncio.to_thread(self.colocated[run.route[1]].abort, run.attempt_id)


@contextlib.contextmanager
def served(
    model_dir,
    num_workers: int,
    tenant_isolation: bool,
    keys: tuple[str, ...] = (KEY_A, KEY_B),
    tokenizer: Any = None,
) -> Iterator[tuple[str, list]]:
    """A predict app behind ``keys`` on a real server, its cluster ``num_workers`` colocated
    workers of the tiny model in this process; yields its URL and the workers."""
    workers = [ColocatedWorker(_config(model_dir), i) for i in range(num_workers)]
    cluster = InProcessCluster(workers)
    routing = RoutingConfig(block_size=4, local_prefill_tokens=0, local_prefill_queue_tokens=0)
    router = Router(cluster, routing=routing)
    asyncio.run(router.refresh())  # no polling after: each routed request counts as load
    service = InferenceService(cluster, router, 100, 0, Timeouts())
    model = ModelInfo("tiny", tokenizer or CharTokenizer(), 1024, 512, 1000)
    served = ServedModels(generation=model, embedding_path=None)
    app = create_predict_app(
        service,
        served,
        None,
        body_limit_mb=1,
        api_keys=keys,
        is_ready=lambda: True,
        tenant_isolation=tenant_isolation,
    )
    try:
        with serving(app) as url:
            yield url, workers
    finally:
        for worker in workers:
            worker.loop.stop()


def _openai_cached(url: str, key: str) -> int:
    body = {"model": "tiny", "prompt": PROBE, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _infer_cached(url: str, key: str) -> int:
    body = {"inputs": PROBE, "parameters": {"max_new_tokens": 2, "details": True}}
    answer = httpx.post(f"{url}/infer", json=body, headers={"api-key": key}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["details"]["cached_tokens"]


def _azure_cached(url: str, key: str) -> int:
    body = {"messages": [{"role": "user", "content": PROBE}], "max_tokens": 2}
    answer = httpx.post(f"{url}{AZURE_CHAT}", json=body, headers={"api-key": key}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


DOORS = {"openai": _openai_cached, "infer": _infer_cached, "azure": _azure_cached}


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("isolation", [True, False])
def test_two_keys_probing_each_others_prefix_over_http(tiny_model_dir, door, isolation):
    cached = DOORS[door]
    with served(tiny_model_dir, 1, isolation) as (url, _):
        assert cached(url, KEY_A) == 0
        # B sends A's prompt: with isolation it learns nothing; without, it sees A's prefix
        assert cached(url, KEY_B) == (0 if isolation else PROBE_CACHED)
        assert cached(url, KEY_A) == PROBE_CACHED  # the same key twice: its own hit
        assert cached(url, KEY_B) == PROBE_CACHED


def test_over_http_the_router_does_not_send_b_after_as_history(tiny_model_dir):
    with served(tiny_model_dir, 2, True) as (url, workers):

        def queried() -> list[int]:  # prompt tokens each worker looked up in its cache
            return [w.engine.blocks.num_queried_tokens for w in workers]

        assert _openai_cached(url, KEY_A) == 0
        assert queried() == [len(PROBE), 0]  # A's prompt went to worker 0
        assert _openai_cached(url, KEY_B) == 0
        assert queried() == [len(PROBE), len(PROBE)]  # B's went by load, not after A's prefix
        assert _openai_cached(url, KEY_A) == PROBE_CACHED
        assert queried() == [2 * len(PROBE), len(PROBE)]  # A's own history draws A back


def test_over_http_without_isolation_the_router_follows_any_keys_prefix(tiny_model_dir):
    with served(tiny_model_dir, 2, False) as (url, workers):
        assert _openai_cached(url, KEY_A) == 0
        assert _openai_cached(url, KEY_B) == PROBE_CACHED  # drawn to worker 0 by A's prefix
        assert workers[1].engine.blocks.num_queried_tokens == 0


def test_a_wrong_key_is_still_refused_before_the_tenant_gate(tiny_model_dir):
    with served(tiny_model_dir, 1, True) as (url, workers):
        body = {"model": "tiny", "prompt": PROBE}
        headers = {"Authorization": "Bearer not-a-key"}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401
        assert workers[0].engine.blocks.num_queried_tokens == 0


@pytest.mark.parametrize("isolation", [True, False])
def test_the_coordinator_takes_tenant_isolation_from_its_config(isolation):
    config = config_with(api_keys=[KEY_A, KEY_B], tenant_isolation=isolation)
    app = Coordinator(config).predict_app()
    gates = [m.kwargs["refuse"] for m in app.user_middleware if "refuse" in m.kwargs]
    tenants = next(gate.keywords["tenants"] for gate in gates if gate.func is record_tenant)
    assert bool(tenants) is isolation
    assert defaults()["http_config"]["tenant_isolation"] is True  # the default with keys
