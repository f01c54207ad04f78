"""The Python client of the worker cluster: starts the actors and runs requests on them.

``pd_separate``: a request goes to a (prefill, decode) pair chosen by the caller. The decode
worker first reserves blocks for the prompt (or refuses, saying why); the prefill worker computes
the prompt and first token, streams that token, and pushes the KV pages to the decode worker's
endpoint; the decode worker's events follow. ``single_node``: one colocated worker does it all.

Failures end the stream with an ``error`` event (``FinishReason.ERROR``) whose ``cause`` names
the kind: ``reservation_refused``, ``handoff_failed``, ``worker_lost`` (the actor died; Ray
restarts it and later requests use the new one) or ``engine_error``. Whatever ends a stream
early, ``abort`` reaches every worker that may still hold the request, in the background if the
caller is cancelled, and without waiting past ``RELEASE_WAIT_S`` for a worker that does not
answer (a stopped process gets the call when it resumes).

The workers are this cluster's own (``cluster_name`` ""), or a shared pool of named, detached
actors in the namespace ``pdserve-<cluster_name>`` that several coordinators use at once
(docs/replicas.md): ``start`` finds the actors the pool has and starts the missing ones, and
``shutdown`` leaves them running (unless ``own_workers`` and no other coordinator holds a lease).
Every request sent names this coordinator (``coordinator_id``) as its owner, and each load poll
(``reports``) renews its lease on every worker and collects the workers' prefix-cache events.

A request's state is its :class:`~coordinator.request_run.RequestRun`, which the caller hands to
``stream``: the cluster sets its phase as the attempt goes (prefilling, handing off, decoding)
and the workers that may hold it (what ``abort`` and the release reach; empty once the stream
ended). It keeps no table of requests of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import ray

from coordinator.cluster_config import ActorResources, ClusterConfig
from coordinator.request_run import RequestRun, RunPhase
from coordinator.worker_pool import actor_options, drop_credentials, pool_credentials, stop_pool
from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig
from engine.kv_events import KvEventBatch, KvSnapshot
from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.token_accounting import pd_output_limit
from prefill_worker.worker import PrefillWorker
from workers.colocated import ColocatedWorker
from workers.contracts import (
    GenerationRequest,
    HandoffResult,
    HandoffTarget,
    Reservation,
    WorkerLoad,
    WorkerReport,
)
from workers.embedding import EmbeddingWorker
from workers.faults import FAULT_INJECTION_ENV, fault_injection_enabled
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)
_UNCLEAN = (FinishReason.ERROR, FinishReason.ABORT)
RELEASE_WAIT_S = 2.0  # how long a finished stream waits for its workers to drop the request
LOAD_TIMEOUT_S = 2.0  # a worker that does not report its load within this is left out (stale)


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        self.colocated: list[Any] = []
        # aborts still on their way to workers (a request's own state is its RequestRun's)
        self._releases: set[asyncio.Task] = set()
        self._cores: list[int] | None = None
        self.ready_info: list[dict[str, Any]] = []
        self._id = uuid.uuid4().hex[:12]  # names this cluster's files on its hosts
        # the owner its requests name on the workers (workers/leases.py)
        self.coordinator_id = f"{socket.gethostname()}-{os.getpid()}-{self._id[:6]}"
        self.embedders: list[Any] = []  # started by the first embed() unless it is the model
        self._embedder_start = asyncio.Lock()
        # (bytes, seconds, path) of each KV move that reached its decode worker
        self.on_handoff: Callable[[int, float, str], None] | None = None
        # (engine role, seconds queued, seconds computing) of each prompt, at its first token
        self.on_prefilled: Callable[[str, float, float], None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> None:
        """Create the actors and wait until every one has loaded its model."""
        cfg = self.config
        self._cores = self._core_plan()
        if not cfg.generation:
            pass  # embeddings only
        elif cfg.deploy_mode == "pd_separate":
            prefill, decode = cfg.prefill_resources, cfg.decode_resources
            transfer = cfg.kv_transfer
            # fresh per start, to the actors only (restarted ones get the same); a plaintext
            # plane still admits only the cluster's senders with them (security.py)
            keys = pool_credentials(cfg.namespace) if transfer.transport != "inprocess" else None
            self.prefills = self._actors(
                PrefillWorker, prefill, cfg.num_prefill, transfer, keys and keys.sender
            )
            self.decodes = self._actors(
                DecodeWorker, decode, cfg.num_decode, transfer, keys and keys.receiver
            )
        else:
            self.colocated = self._actors(
                ColocatedWorker, cfg.colocated_resources, cfg.num_colocated
            )
        if cfg.embedding_model_path is not None and not cfg.generation:
            self.embedders = [self._embedder()]  # the model served: up before the service
        self.ready_info = ray.get(
            [a.ready.remote() for a in [*self.actors, *self.embedders]], timeout=timeout_s
        )

    def describe(self) -> list[dict[str, Any]]:
        """Each worker's ``ready`` answer (role, instance, pid, cores, model) as of ``start``."""
        return list(self.ready_info)

    def stop_pool(self) -> list[str]:
        """Stop the shared pool's actors that this configuration names; their names."""
        cfg = self.config
        if cfg.namespace is None:
            raise ValueError("stop_pool needs a cluster_name: a private cluster has no pool")
        if cfg.deploy_mode == "pd_separate":
            counts = {"prefill": cfg.num_prefill, "decode": cfg.num_decode}
        else:
            counts = {"colocated": cfg.num_colocated}
        names = [f"{role}-{i}" for role, count in counts.items() for i in range(count)]
        return stop_pool(cfg.namespace, [*names, "embedding-0"])

    def _embedder(self) -> Any:
        """The embedding worker (its model loads in its own process, ~320 MiB)."""
        cfg = self.config
        return (
            ray.remote(EmbeddingWorker)
            .options(
                num_cpus=cfg.embedding_resources.num_cpus,
                max_restarts=-1,
                max_concurrency=256,
                **actor_options(self.config.namespace, "embedding-0"),
            )
            .remote(cfg.embedding_model_path, cfg.embedding_resources.num_threads)
        )

    def _core_plan(self) -> list[int] | None:
        """Cores to hand out in actor order, when pinning applies: a one-node Ray with at least
        as many cores as the actors ask for (else None: the OS schedules)."""
        cfg = self.config
        if not cfg.pin_cpus or not cfg.generation or len(ray.nodes()) != 1:
            return None
        if cfg.deploy_mode == "pd_separate":
            wanted = [cfg.prefill_resources.num_threads] * cfg.num_prefill + [
                cfg.decode_resources.num_threads
            ] * cfg.num_decode
        else:
            wanted = [cfg.colocated_resources.num_threads] * cfg.num_colocated
        cores = sorted(os.sched_getaffinity(0))
        return cores if sum(wanted) <= len(cores) else None

    def _take_cores(self, count: int) -> tuple[int, ...] | None:
        if self._cores is None:
            return None
        taken, self._cores = self._cores[:count], self._cores[count:]
        return tuple(taken)

    def _actors(
        self, cls: type[WorkerRuntime], resources: ActorResources, count: int, *args: Any
    ) -> list[Any]:
        return [
            self._actor(cls, resources, i, *args, cpu_ids=self._take_cores(resources.num_threads))
            for i in range(count)
        ]

    def _actor(
        self,
        cls: type[WorkerRuntime],
        resources: ActorResources,
        instance: int,
        *args: Any,
        cpu_ids: tuple[int, ...] | None = None,
    ) -> Any:
        """Worker ``instance`` of ``cls``, built from the engine config (with ``resources``'
        threads and device) and ``args``, pinned to ``cpu_ids`` (None: not pinned)."""
        engine = replace(
            self.config.engine,
            num_threads=resources.num_threads,
            device="cuda" if resources.num_gpus > 0 else self.config.engine.device,
            cache=self._cache_of(cls),
        )
        threads = str(resources.num_threads)
        # glibc's default arenas: MALLOC_ARENA_MAX=2 saved nothing measurable here and made a
        # served stream's prompts 1.6x slower (docs/performance/memory.md)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if fault_injection_enabled():
            env[FAULT_INJECTION_ENV] = "1"
        return (
            ray.remote(cls)
            .options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                resources=dict(resources.resources),
                max_restarts=-1,
                max_task_retries=0,
                max_concurrency=256,
                runtime_env={"env_vars": env},
                **actor_options(self.config.namespace, f"{cls.role}-{instance}"),
            )
            .remote(
                engine,
                *args,
                instance=instance,
                cpu_ids=cpu_ids,
            )
        )

    def _cache_of(self, cls: type) -> CacheConfig:
        """The KV cache of a ``cls`` actor: a prefill engine's may be sized on its own."""
        cache, prefill_mb = self.config.engine.cache, self.config.prefill_kv_memory_mb
        if cls is not PrefillWorker or not prefill_mb:
            return cache
        return replace(cache, memory_mb=prefill_mb, num_blocks=None)

    def worker(self, role: str, instance: int) -> Any:
        """The actor of ``role`` (prefill, decode, colocated) number ``instance``."""
        pools = {"prefill": self.prefills, "decode": self.decodes, "colocated": self.colocated}
        if role not in pools:
            raise ValueError(f"role must be one of {', '.join(pools)}, got {role!r}")
        if not 0 <= instance < len(pools[role]):
            raise IndexError(f"instance must be in [0, {len(pools[role])}), got {instance}")
        return pools[role][instance]

    @property
    def actors(self) -> list[Any]:
        return [*self.prefills, *self.decodes, *self.colocated]

    def shutdown(self) -> None:
        """Stop the workers if they are this cluster's own, or the shared pool's when
        ``own_workers`` and no other coordinator holds a lease on them; else leave them."""
        if self.config.namespace is None or (self.config.own_workers and not self.others()):
            for actor in [*self.actors, *self.embedders]:
                ray.kill(actor, no_restart=True)
            if self.config.namespace is not None:
                drop_credentials(self.config.namespace)
        self.prefills, self.decodes, self.colocated, self.embedders = [], [], [], []

    def others(self) -> set[str]:
        """The other coordinators holding a live lease on any worker (asked all at once)."""
        calls = [actor.live_coordinators.remote() for actor in self.actors]
        owners: set[str] = set()
        for answer in ray.get(calls, timeout=LOAD_TIMEOUT_S * 5):
            owners.update(answer)
        return owners - {self.coordinator_id}

    async def embed(self, texts: list[str]) -> dict[str, Any]:
        """Embeddings (float32 ``[n, d]``) and token counts from the embedding worker, started by
        the first call when the cluster also generates (no process holds an embedding model
        that no request asked for)."""
        if self.config.embedding_model_path is None:
            raise RuntimeError("this cluster has no embedding worker")
        if not self.embedders:
            async with self._embedder_start:
                if not self.embedders:
                    embedder = self._embedder()
                    await embedder.ready.remote()
                    self.embedders = [embedder]
        return await self.embedders[0].embed.remote(texts)

    # ---- requests --------------------------------------------------------------------------------

    async def generate(
        self, request: GenerationRequest, prefill: int | None = 0, decode: int = 0
    ) -> AsyncIterator[TokenEvent]:
        """Token events of one request of its own (no migration) on the pair ``(prefill,
        decode)``: ``stream`` of a fresh run routed there."""
        run = RequestRun(request)
        run.route_to((prefill, decode))
        async with contextlib.aclosing(self.stream(run)) as events:
            async for event in events:
                yield event

    async def stream(self, run: RequestRun) -> AsyncGenerator[TokenEvent, None]:
        """Token events of ``run``'s attempt on ``run.route``; the last one is finished (``error``
        set on failure). In ``pd_separate`` a route whose prefill side is None has the decode
        worker prefill it itself. The run's phase and workers follow the stream.

        However the stream ends (finished, failed, or closed early by the caller), every worker
        that may still hold the attempt is told to drop it unless it ended cleanly there.
        """
        clean = False
        if run.attempt.owner != self.coordinator_id:  # each attempt names this coordinator
            run.attempt = replace(run.attempt, owner=self.coordinator_id)
        try:
            events, role = self._attempt(run)
            async for event in events:
                if event.queued_s is not None and self.on_prefilled is not None:
                    self.on_prefilled(role, event.queued_s, event.prefill_s or 0.0)
                if event.finish_reason == FinishReason.ERROR and run.aborted:
                    event = TokenEvent.aborted(run.attempt_id)  # the caller's abort, not a failure
                # ended where it ran, with nothing left on any worker
                clean = event.finished and event.finish_reason not in _UNCLEAN
                yield event
        finally:
            if clean:
                run.workers = []
            else:
                await self._release(run)

    def _attempt(self, run: RequestRun) -> tuple[AsyncIterator[TokenEvent], str]:
        """The events of ``run``'s attempt, and the role of the worker computing its prompt."""
        if run.route is None:
            raise ValueError(f"request {run.request_id} streams before it was routed")
        prefill, decode = run.route
        if run.aborted:  # between two attempts
            return _aborted(run), "none"
        if self.config.deploy_mode == "single_node":
            worker = self.colocated[decode % len(self.colocated)]
            return self._generate_alone(run, worker), "colocated"
        if prefill is None:
            return self._generate_alone(run, self.decodes[decode], self._limit(run)), "decode"
        return self._generate_pd(run, self.prefills[prefill], self.decodes[decode]), "prefill"

    def _limit(self, run: RequestRun) -> int:
        """A disaggregated request's output limit, whichever path it takes (token-accounting)."""
        max_new_tokens = run.request.params.max_new_tokens
        return pd_output_limit(max_new_tokens, self.config.engine.scheduler.max_iter_times)

    async def _generate_pd(
        self, run: RequestRun, p_worker: Any, d_worker: Any
    ) -> AsyncIterator[TokenEvent]:
        request, limit = run.attempt, self._limit(run)
        run.workers = [p_worker, d_worker]
        # the first token is the last: it ends on the prefill worker, no pages move
        target = HandoffTarget("", limit)
        if limit > len(request.output_token_ids) + 1:
            reservation = await self._reserve(d_worker, request, limit)
            if not reservation.granted:
                refusal = f"decode worker refused: {reservation.reason}"
                yield TokenEvent.failure(request.request_id, refusal, "reservation_refused")
                return
            target = HandoffTarget.from_reservation(reservation, limit)
        if run.aborted:  # aborted while its blocks were being reserved
            yield TokenEvent.aborted(request.request_id)
            return
        run.advance(RunPhase.PREFILLING)
        handoff: HandoffResult | None = None
        async for item in self._prefilled(run, p_worker, target):
            if isinstance(item, HandoffResult):
                handoff = item
                break
            yield item
        if handoff is not None:
            async for event in self._handed_off(run, d_worker, handoff):
                yield event

    async def _prefilled(
        self, run: RequestRun, p_worker: Any, target: HandoffTarget
    ) -> AsyncIterator[Any]:
        """The prefill worker's stream: the first token, then the hand-off's result (none when
        the request ended on that token, or failed)."""
        stream = p_worker.prefill.options(num_returns="streaming").remote(run.attempt, target)
        async for item in self._stream(run.attempt_id, stream):
            if isinstance(item, TokenEvent) and not item.finished:
                run.advance(RunPhase.HANDING_OFF)  # the first token: the pages go now
            elif isinstance(item, TokenEvent) and target.endpoint:
                await self._release(run)  # ended on its first token: free the reservation
            yield item

    async def _handed_off(
        self, run: RequestRun, d_worker: Any, handoff: HandoffResult
    ) -> AsyncIterator[TokenEvent]:
        """After the hand-off: its failure, or the decode worker's stream."""
        if not handoff.ok:
            error = handoff.error or "KV hand-off failed"
            yield TokenEvent.failure(run.attempt_id, error, "handoff_failed")
            return
        if self.on_handoff is not None:
            self.on_handoff(handoff.num_bytes, handoff.transfer_seconds, handoff.path)
        run.workers = [d_worker]
        run.advance(RunPhase.DECODING)
        stream = d_worker.stream.options(num_returns="streaming").remote(run.attempt_id)
        async for event in self._stream(run.attempt_id, stream):
            yield event

    async def _generate_alone(self, run: RequestRun, worker: Any, *args: Any) -> AsyncIterator[Any]:
        """One worker computes the prompt and decodes: the colocated one, or a decode worker
        prefilling itself (``args``: its output limit)."""
        run.workers = [worker]
        run.advance(RunPhase.PREFILLING)
        stream = worker.generate.options(num_returns="streaming").remote(run.attempt, *args)
        async for event in self._stream(run.attempt_id, stream):
            if event.token_id is not None:
                run.advance(RunPhase.DECODING)
            yield event

    async def _reserve(self, d_worker: Any, request: GenerationRequest, limit: int) -> Reservation:
        """Blocks on ``d_worker`` for a request decoding up to ``limit`` outputs, waiting for
        room no longer than the request may take."""
        wait_s = min(x for x in (self.config.reservation_wait_s, request.timeout_s) if x)
        try:
            return await d_worker.reserve.remote(request, wait_s, limit)
        except ray.exceptions.RayError as exc:
            return Reservation.refused(type(exc).__name__)

    async def _stream(self, request_id: str, stream: Any) -> AsyncIterator[Any]:
        """Items of a worker stream; a broken stream (the worker died) ends with an error."""
        try:
            async for ref in stream:
                yield await ref
        except ray.exceptions.RayError as exc:
            error = f"worker failed: {type(exc).__name__}: {exc}"[:500]
            yield TokenEvent.failure(request_id, error, "worker_lost")

    async def _release(self, run: RequestRun) -> None:
        """Tell every worker that may hold ``run``'s attempt to drop it, and wait (up to
        ``RELEASE_WAIT_S``); from now on it is held nowhere."""
        workers, run.workers = run.workers, []
        await self._release_in_background(run.attempt_id, workers)

    async def _release_in_background(self, request_id: str, workers: list[Any]) -> None:
        """Abort ``request_id`` on ``workers`` in a task of its own: it goes on when the caller
        is cancelled, and the caller waits for it at most ``RELEASE_WAIT_S``."""
        if not workers:
            return
        task = asyncio.ensure_future(_abort_on(workers, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), RELEASE_WAIT_S)

    async def abort(self, run: RequestRun) -> None:
        """End ``run`` in flight: its stream ends with ``abort`` wherever it is."""
        run.abort()
        await _abort_on(list(run.workers), run.attempt_id)

    async def loads(self) -> list[WorkerLoad]:
        """Queue, running and free-block figures of every worker, asked all at once; a worker
        that is dead, restarting or does not answer within ``LOAD_TIMEOUT_S`` is left out."""
        answers = await asyncio.gather(*(_load_of(actor) for actor in self.actors))
        return [load for load in answers if load is not None]

    async def reports(self, cursors: dict[tuple[str, int], tuple[str, int]]) -> list[WorkerReport]:
        """Every worker's load poll as this coordinator (renewing its lease there), with its
        prefix-cache events after ``cursors[(role, instance)]`` (epoch, seq; none: from a
        snapshot); left out as in ``loads``."""
        calls = [
            _report_of(actor, self.coordinator_id, *cursors.get(key, ("", -1)))
            for key, actor in self._keyed_actors()
        ]
        answers = await asyncio.gather(*calls)
        return [report for report in answers if report is not None]

    async def kv_events(
        self, role: str, instance: int, epoch: str, seq: int, wait_s: float
    ) -> KvEventBatch:
        """Worker ``(role, instance)``'s prefix-cache events after (epoch, seq), once there is
        one or ``wait_s`` passed (a long poll)."""
        return await self.worker(role, instance).kv_events.remote(epoch, seq, wait_s)

    async def kv_snapshot(self, role: str, instance: int) -> KvSnapshot:
        """Every hash in worker ``(role, instance)``'s prefix cache now."""
        return await self.worker(role, instance).kv_snapshot.remote()

    def _keyed_actors(self) -> list[tuple[tuple[str, int], Any]]:
        pools = {"prefill": self.prefills, "decode": self.decodes, "colocated": self.colocated}
        return [((role, i), actor) for role, pool in pools.items() for i, actor in enumerate(pool)]


async def _aborted(run: RequestRun) -> AsyncIterator[TokenEvent]:
    yield TokenEvent.aborted(run.attempt_id)


async def _load_of(actor: Any) -> WorkerLoad | None:
    try:
        return await asyncio.wait_for(actor.load.remote(), LOAD_TIMEOUT_S)
    except (TimeoutError, ray.exceptions.RayError):
        return None


async def _report_of(actor: Any, owner: str, epoch: str, seq: int) -> WorkerReport | None:
    try:
        return await asyncio.wait_for(actor.report.remote(owner, epoch, seq), LOAD_TIMEOUT_S)
    except (TimeoutError, ray.exceptions.RayError):
        return None


async def _abort_on(workers: list[Any], request_id: str) -> None:
    """Abort ``request_id`` on every worker at once (idempotent; dead workers hold nothing)."""
    calls = [worker.abort.remote(request_id) for worker in workers]
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, Exception) and not isinstance(outcome, ray.exceptions.RayError):
            log.warning("abort of %s failed: %r", request_id, outcome)
