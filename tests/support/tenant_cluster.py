"""Clusters of real tiny engines in-process, behind a real HTTP server with tenants' keys: what the
tenant, KV-event, lease and prefix-cache tests share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from coordinator.api.app import create_predict_app
from coordinator.inference import InferenceService, Timeouts
from coordinator.model_info import ModelInfo
from coordinator.request_run import RequestRun
from coordinator.router import Router
from coordinator.routing.config import RoutingConfig
from coordinator.served_model import ServedModels
from engine.config import CacheConfig, EngineConfig
from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from tests.support.channel_reader import ChannelReader
from tests.support.door_fakes import AZURE_CHAT, CharTokenizer, serving
from workers.colocated import ColocatedWorker

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


@dataclass
class _Mode:
    deploy_mode: str = "single_node"


class InProcessCluster:
    """``single_node`` with real colocated workers in this process (no Ray): what the router
    and the service ask of a cluster. It is one coordinator, attached to every worker's token
    channel (``reader``), and reads each request's events there."""

    def __init__(self, workers: list[ColocatedWorker]) -> None:
        self.config = _Mode()
        self.prefills: list = []
        self.decodes: list = []
        self.colocated = workers
        self.reader = ChannelReader(*workers)

    async def loads(self):
        return [await asyncio.to_thread(w.load) for w in self.colocated]

    async def reports(self, cursors):
        """``Cluster.reports``: the workers' real load polls, prefix-cache events included."""
        return [
            await asyncio.to_thread(
                w.report, self.reader.owner, *cursors.get(("colocated", i), ("", -1))
            )
            for i, w in enumerate(self.colocated)
        ]

    async def kv_snapshot(self, role, instance):
        return await asyncio.to_thread(self.colocated[instance].kv_snapshot)

    async def kv_events(self, role, instance, epoch, seq, wait_s):
        """``Cluster.kv_events``: the worker's real long poll."""
        worker = self.colocated[instance]
        return await asyncio.to_thread(worker.kv_events, epoch, seq, wait_s)

    async def stream(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        assert run.route is not None
        worker = self.colocated[run.route[1]]
        request = self.reader.request(run.attempt)
        submitted = await asyncio.to_thread(worker.generate, request)
        if not submitted.accepted:
            yield TokenEvent.failure(request.request_id, submitted.error or "not attached")
            return
        while True:
            items = await asyncio.to_thread(self.reader.take, worker, request.request_id, 30.0)
            assert items, f"no event of {request.request_id} within 30 s"
            for item in items:
                assert isinstance(item, TokenEvent), item  # a colocated worker hands nothing off
                yield item
                if item.finished:
                    return

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
    asyncio.run(router.view.refresh())  # no polling after: each routed request counts as load
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
        cluster.reader.close()
        for worker in workers:
            worker.close()


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
