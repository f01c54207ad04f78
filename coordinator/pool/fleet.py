"""The fleet: the worker actors a coordinator uses, from start to shutdown.

The workers are the coordinator's own (``cluster_name`` ""), or a shared pool of named, detached
actors in the namespace ``pdserve-<cluster_name>`` that several coordinators use at once
(docs/replicas.md): ``start`` finds the actors the pool has and starts the missing ones, and
``shutdown`` leaves them running (unless ``own_workers`` and no other coordinator holds a lease).
Each actor owns the cores Ray gave it, pinned on a one-node Ray when they add up; the embedding
worker starts with the first embeddings request unless it is the model served. Every load poll
(``reports``) renews this coordinator's lease (``coordinator_id``) on every worker and collects
the workers' prefix-cache events.

Each generating worker sends its requests' events on a token channel of its own
(``workers/token_channel.py``); the fleet's :class:`TokenStreams` is this coordinator's end of
them all. A channel is attached (connected, welcomed) by each poll for the workers that answered
and are not attached yet, again when a worker comes back under another pid (its actor restarted:
a new endpoint), and whenever a worker refuses a request for not being attached
(:meth:`Fleet.attach`). It admits only the pool's members: the coordinator holds the share of the
pool's credentials that is the counterpart of the worker's.
How one request runs on these actors: ``coordinator/cluster.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import uuid
from dataclasses import replace
from typing import Any

import ray

from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.pool.shared import actor_options, drop_credentials, pool_credentials, stop_pool
from coordinator.pool.shared_responses import ACTOR_NAME as RESPONSES_ACTOR
from coordinator.pool.token_stream import WorkerKey
from coordinator.pool.token_streams import TokenChannelError, TokenStreams, counterpart
from decode_worker.worker import DecodeWorker
from elastic_worker.worker import ElasticWorker
from engine.config import CacheConfig, kv_bind_address
from engine.kv_events import KvEventBatch, KvSnapshot
from engine.transfer.security import ClusterCredentials, KVCredentials, transfer_credentials
from prefill_worker.worker import PrefillWorker
from workers.colocated import ColocatedWorker
from workers.contracts import (
    EmbedderIdentity,
    RoleState,
    WorkerIdentity,
    WorkerLoad,
    WorkerReport,
)
from workers.embedding import EmbeddingWorker
from workers.faults import FAULT_INJECTION_ENV, fault_injection_enabled
from workers.runtime import CONCURRENCY_GROUPS, WorkerRuntime

log = logging.getLogger(__name__)
# the Ray node label a coordinator's own node carries (deploy/helm: its ``ray start --labels``)
NODE_ROLE_LABEL, COORDINATOR_NODE = "pdserve.io/role", "coordinator"
LOAD_TIMEOUT_S = 2.0  # a worker that does not report its load within this is left out (stale)


class Fleet:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        self.colocated: list[Any] = []
        # elastic_roles: every worker, prefill or decode by turns (None: released)
        self.elastic: list[Any | None] = []
        self._elastic_keys: ClusterCredentials | None = None
        # each elastic worker's role as last heard (a poll, a switch), by instance
        self.roles: dict[int, RoleState] = {}
        self._cores: list[int] | None = None
        self.ready_info: list[WorkerIdentity | EmbedderIdentity] = []  # as of ``start``
        self.identities: dict[tuple[str, int], WorkerIdentity] = {}  # by (role, instance), current
        self._id = uuid.uuid4().hex[:12]  # names this cluster's files on its hosts
        # the owner its requests name on the workers (workers/leases.py)
        self.coordinator_id = f"{socket.gethostname()}-{os.getpid()}-{self._id[:6]}"
        self.embedders: list[Any] = []  # started by the first embed() unless it is the model
        self._embedder_start = asyncio.Lock()
        self._streams: TokenStreams | None = None  # made on the event loop that reads them
        self._channel_keys: dict[str, KVCredentials | None] = {}  # role -> what we connect with
        # attaches under way, by (worker, endpoint, refused): every caller shares one
        self._attaching: dict[tuple[WorkerKey, str, bool], asyncio.Future[None]] = {}
        self._attach_locks: dict[WorkerKey, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def start(self, timeout_s: float = 300.0) -> None:
        """Create the actors and wait until every one has loaded its model."""
        cfg = self.config
        self._cores = self._core_plan()
        # fresh per start, to the actors only (restarted ones get the same); a plaintext plane
        # still admits only the cluster's members with them (security.py)
        keys = pool_credentials(cfg.namespace) if cfg.kv.transport != "inprocess" else None
        if not cfg.generation:
            pass  # embeddings only
        elif cfg.deploy_mode == "pd_separate":
            self._start_pd(keys)
        else:
            self._start_colocated(keys)
        if cfg.embedding_model_path is not None and not cfg.generation:
            self.embedders = [self._embedder()]  # the model served: up before the service
        self.ready_info = ray.get(
            [a.ready.remote() for a in [*self.actors, *self.embedders]], timeout=timeout_s
        )
        workers = [i for i in self.ready_info if isinstance(i, WorkerIdentity)]
        self.identities = {(i.role, i.instance): i for i in workers}

    def _start_pd(self, keys: ClusterCredentials | None) -> None:
        cfg, transfer = self.config, self.config.kv
        sender, receiver = (keys.sender, keys.receiver) if keys else (None, None)
        # peer pulls: prefill workers receive prefixes, decode workers send them
        pulls = transfer.peer_pull
        if cfg.elastic_roles:
            self._start_elastic(keys)
            return
        self.prefills = self._actors(
            PrefillWorker, cfg.prefill_resources, cfg.num_prefill, transfer, sender,
            pull_credentials=receiver if pulls else None,
        )  # fmt: skip
        self.decodes = self._actors(
            DecodeWorker, cfg.decode_resources, cfg.num_decode, transfer, receiver,
            pull_credentials=sender if pulls else None,
        )  # fmt: skip
        self._channel_keys = {
            "prefill": _counterpart(keys, transfer_credentials(transfer, sender)),
            "decode": _counterpart(keys, transfer_credentials(transfer, receiver)),
        }

    def _start_elastic(self, keys: ClusterCredentials | None) -> None:
        """Elastic workers (``elastic_worker/worker.py``): the first ``num_prefill`` start as
        prefill workers, the next ``num_decode`` as decode workers. Each holds both shares of the KV
        plane's credentials (it sends hand-offs and receives them by turns); its token channel
        is secured as a decode worker's is."""
        cfg = self.config
        self._elastic_keys = keys
        total = cfg.num_prefill + cfg.num_decode
        self.roles = {n: RoleState("prefill" if n < cfg.num_prefill else "decode")
                      for n in range(total)}  # fmt: skip
        cores = cfg.decode_resources.num_threads
        self.elastic = [
            self.elastic_actor(n, self.roles[n].serving, self._take_cores(cores))
            for n in range(total)
        ]
        share = transfer_credentials(cfg.kv, keys.receiver if keys else None)
        self._channel_keys = {"elastic": _counterpart(keys, share)}

    def elastic_actor(
        self, instance: int, serving: str, cpu_ids: tuple[int, ...] | None = None
    ) -> Any:
        """Elastic worker ``instance``'s actor, starting in role ``serving``."""
        keys, transfer = self._elastic_keys, self.config.kv
        sender, receiver = (keys.sender, keys.receiver) if keys else (None, None)
        return self._actor(
            ElasticWorker, self.config.decode_resources, instance, transfer, receiver,
            pull_credentials=receiver if transfer.peer_pull else None,
            send_credentials=sender, serving=serving, cpu_ids=cpu_ids,
        )  # fmt: skip

    def key(self, role: str, instance: int) -> WorkerKey:
        """The key of the worker serving ``role`` as number ``instance`` of a route: an elastic
        worker's is its own for life, whichever role it serves."""
        return ("elastic", instance) if self.elastic else (role, instance)

    def gate(self, key: WorkerKey) -> dict[str, int]:
        """What a call bringing work to worker ``key`` names besides its request: an elastic
        worker's role epoch as last heard (it refuses the call at another)."""
        role_state = self.roles.get(key[1]) if key[0] == "elastic" else None
        return {} if role_state is None else {"epoch": role_state.epoch}

    async def switch(self, instance: int, target: str, wait_s: float) -> tuple[str, RoleState]:
        """Switch elastic worker ``instance`` to ``target`` from the epoch last heard, waiting
        up to ``wait_s`` for the switch to end: ("", its role then) when it started, else (why
        not, its role now)."""
        if not self.elastic:
            raise ValueError("workers switch roles only with elastic_roles")
        actor = self.worker("elastic", instance)
        epoch = self.roles[instance].epoch
        refusal, role_state = await actor.switch_role.remote(target, epoch, wait_s)
        self.roles[instance] = role_state
        return refusal, role_state

    async def role_states(self) -> dict[int, RoleState]:
        """Every elastic worker's role now (a worker that does not answer: as last heard)."""
        live = [(n, actor) for n, actor in enumerate(self.elastic) if actor is not None]
        answers = await asyncio.gather(*(_answer(actor.role_state) for _, actor in live))
        for (instance, _), role_state in zip(live, answers, strict=True):
            if role_state is not None:
                self._keep_role(instance, role_state)
        return self.roles

    def _start_colocated(self, keys: ClusterCredentials | None) -> None:
        """Colocated workers, their token channels secured as a decode worker's KV plane is."""
        cfg = self.config
        share = transfer_credentials(cfg.kv, keys.receiver if keys else None)
        host = kv_bind_address(cfg.kv.host) if share else "127.0.0.1"
        channel = {"channel_host": host, "channel_credentials": share}
        self.colocated = self._actors(
            ColocatedWorker, cfg.colocated_resources, cfg.num_colocated, **channel
        )
        self._channel_keys = {"colocated": _counterpart(keys, share)}

    def describe(self) -> list[dict[str, Any]]:
        """Each worker's ``ready`` answer (role, instance, pid, cores, model) as of ``start``."""
        return [identity.describe() for identity in self.ready_info]

    def identity(self, load: WorkerLoad) -> WorkerIdentity:
        """What the worker of ``load`` is, as its latest ``ready`` said (blank before one)."""
        key = (load.role, load.instance)
        return self.identities.get(key, WorkerIdentity(*key, 0))

    def stop_pool(self) -> list[str]:
        """Stop the shared pool's actors that this configuration names; their names."""
        cfg = self.config
        if cfg.namespace is None:
            raise ValueError("stop_pool needs a cluster_name: a private cluster has no pool")
        if cfg.deploy_mode == "pd_separate" and cfg.elastic_roles:
            counts = {"elastic": cfg.num_prefill + cfg.num_decode}
        elif cfg.deploy_mode == "pd_separate":
            counts = {"prefill": cfg.num_prefill, "decode": cfg.num_decode}
        else:
            counts = {"colocated": cfg.num_colocated}
        names = [f"{role}-{i}" for role, count in counts.items() for i in range(count)]
        return stop_pool(cfg.namespace, [*names, "embedding-0", RESPONSES_ACTOR])

    def _embedder(self) -> Any:
        """The embedding worker (its model loads in its own process, ~320 MiB)."""
        cfg = self.config
        return (
            ray.remote(EmbeddingWorker)
            .options(
                num_cpus=cfg.embedding_resources.num_cpus,
                max_restarts=-1,
                max_concurrency=256,
                # it asks for no CPU: kept off a coordinator's own node (deploy/helm labels it)
                label_selector={NODE_ROLE_LABEL: f"!{COORDINATOR_NODE}"},
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
        prefill, decode = cfg.prefill_resources.num_threads, cfg.decode_resources.num_threads
        if cfg.deploy_mode == "pd_separate" and cfg.elastic_roles:
            wanted = [decode] * (cfg.num_prefill + cfg.num_decode)
        elif cfg.deploy_mode == "pd_separate":
            wanted = [prefill] * cfg.num_prefill + [decode] * cfg.num_decode
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
        self,
        cls: type[WorkerRuntime],
        resources: ActorResources,
        count: int,
        *args: Any,
        **kwargs: Any,
    ) -> list[Any]:
        cores = resources.num_threads
        return [
            self._actor(cls, resources, i, *args, cpu_ids=self._take_cores(cores), **kwargs)
            for i in range(count)
        ]

    def _actor(
        self,
        cls: type[WorkerRuntime],
        resources: ActorResources,
        instance: int,
        *args: Any,
        cpu_ids: tuple[int, ...] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Worker ``instance`` of ``cls``, built from the engine config (with ``resources``'
        threads and device), ``args`` and ``kwargs``, pinned to ``cpu_ids`` (None: not
        pinned)."""
        engine = replace(
            self.config.engine,
            num_threads=resources.num_threads,
            device="cuda" if resources.num_gpus > 0 else self.config.engine.device,
            cache=self._cache_of(cls),
        )
        threads = str(resources.num_threads)
        # glibc's default arenas: fewer (MALLOC_ARENA_MAX) were tried and slowed prompts down
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if fault_injection_enabled():
            env[FAULT_INJECTION_ENV] = "1"
        env["GOMP_SPINCOUNT"] = str(self.config.omp_spin_count)
        return (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls)  # type: ignore[call-overload]
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
            .remote(engine, *args, instance=instance, cpu_ids=cpu_ids, **kwargs)
        )

    def _cache_of(self, cls: type) -> CacheConfig:
        """The KV cache of a ``cls`` actor: a prefill engine's may be sized on its own."""
        cache, prefill_mb = self.config.engine.cache, self.config.prefill_kv_memory_mb
        if cls is not PrefillWorker or not prefill_mb:
            return cache
        return replace(cache, memory_mb=prefill_mb, num_blocks=None)

    def worker(self, role: str, instance: int) -> Any:
        """The actor of ``role`` (prefill, decode, colocated, elastic) number ``instance``; with
        elastic workers, ``prefill`` and ``decode`` name the elastic worker ``instance``."""
        if self.elastic and role in ("prefill", "decode"):
            role = "elastic"
        pools = self._pools()
        if role not in pools:
            raise ValueError(f"role must be one of {', '.join(pools)}, got {role!r}")
        if not 0 <= instance < len(pools[role]):
            raise IndexError(f"instance must be in [0, {len(pools[role])}), got {instance}")
        actor = pools[role][instance]
        if actor is None:
            raise IndexError(f"{role} worker {instance} was released from the pool")
        return actor

    @property
    def actors(self) -> list[Any]:
        elastic = [actor for actor in self.elastic if actor is not None]
        return [*self.prefills, *self.decodes, *self.colocated, *elastic]

    def _pools(self) -> dict[str, list[Any]]:
        return {
            "prefill": self.prefills,
            "decode": self.decodes,
            "colocated": self.colocated,
            "elastic": self.elastic,
        }

    def shutdown(self) -> None:
        """Stop the workers if they are this cluster's own, or the shared pool's when
        ``own_workers`` and no other coordinator holds a lease on them; else leave them."""
        if self.config.namespace is None or (self.config.own_workers and not self.others()):
            for actor in [*self.actors, *self.embedders]:
                ray.kill(actor, no_restart=True)
            if self.config.namespace is not None:
                drop_credentials(self.config.namespace)
        self.prefills, self.decodes, self.colocated, self.embedders = [], [], [], []
        self.elastic = []
        if self._streams is not None:  # without its loop, which may be gone
            self._streams.abandon()
            self._streams = None

    def others(self) -> set[str]:
        """The other coordinators holding a live lease on any worker (asked all at once)."""
        calls = [actor.live_coordinators.remote() for actor in self.actors]
        owners: set[str] = set().union(*ray.get(calls, timeout=LOAD_TIMEOUT_S * 5))
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

    # ---- polls ---------------------------------------------------------------------------------

    async def loads(self) -> list[WorkerLoad]:
        """Queue, running and free-block figures of every worker, asked all at once; a worker
        that is dead, restarting or does not answer within ``LOAD_TIMEOUT_S`` is left out."""
        answers = await asyncio.gather(*(_answer(actor.load) for actor in self.actors))
        return [load for load in answers if load is not None]

    async def reports(self, cursors: dict[tuple[str, int], tuple[str, int]]) -> list[WorkerReport]:
        """Every worker's load poll as this coordinator (renewing its lease there), with its
        prefix-cache events after ``cursors[(role, instance)]`` (epoch, seq; none: from a
        snapshot); left out as in ``loads``."""
        calls = [
            _answer(actor.report, self.coordinator_id, *cursors.get(key, ("", -1)))
            for key, actor in self._keyed_actors()
        ]
        reports = [report for report in await asyncio.gather(*calls) if report is not None]
        for report in reports:
            self._heard(report.load)
        await self._identify([report.load for report in reports])
        await self._attach_all([(r.load.role, r.load.instance) for r in reports])
        return reports

    def _heard(self, load: WorkerLoad) -> None:
        """Keep an elastic worker's role as ``load`` says, unless a switch answered since told
        of a later epoch (a restarted actor starts over: its role is the load's)."""
        if load.role_state is not None:
            restarted = self.identity(load).pid != load.pid
            self._keep_role(load.instance, load.role_state, restarted)

    def _keep_role(self, instance: int, role_state: RoleState, restarted: bool = False) -> None:
        """Keep ``role_state`` as elastic worker ``instance``'s unless it is older than the one
        known (an answer sent before a switch that answered since); a released worker's is
        dropped."""
        known = self.roles.get(instance)
        if known is not None and (restarted or role_state.epoch >= known.epoch):
            self.roles[instance] = role_state

    async def _identify(self, loads: list[WorkerLoad]) -> None:
        """Ask ``ready`` again of each worker whose pid is not its identity's (its actor
        restarted); one that does not answer is asked again at the next poll."""
        moved = [(w.role, w.instance) for w in loads if self.identity(w).pid != w.pid]
        await asyncio.gather(*map(self.identify, moved))

    async def identify(self, key: WorkerKey) -> None:
        """Ask worker ``key`` who it is now (its token channel, after a restart); kept unless it
        does not answer within ``LOAD_TIMEOUT_S``."""
        identity = await _answer(self.worker(*key).ready)
        if identity is not None:
            self.identities[key] = identity

    # ---- token channels ------------------------------------------------------------------------

    @property
    def streams(self) -> TokenStreams:
        """This coordinator's end of the workers' token channels, made on first use on the
        running event loop (and made again on another loop: the old one's tasks are gone)."""
        loop = asyncio.get_running_loop()
        if self._streams is None or self._streams.loop is not loop:
            if self._streams is not None:
                self._streams.abandon()
            self._streams = TokenStreams(self.coordinator_id)
            self._attaching.clear()
            self._attach_locks.clear()
        return self._streams

    async def attach(self, key: WorkerKey, endpoint: str = "", refused: bool = False) -> None:
        """Attach to worker ``key``'s token channel at ``endpoint`` (by default the one its
        identity names), unless attached there already; ``refused``: the worker said we are
        not (say hello again on a channel up there). TokenChannelError if it does not come
        up. Callers of the same attach share the one under way: while a worker restarts, every
        request that finds its channel down waits for one try (``CONNECT_TIMEOUT_S``), not for
        a queue of them, and so does the load poll."""
        endpoint = endpoint or self.identities[key].token_channel
        if not endpoint:
            raise TokenChannelError(f"worker {key} names no token channel")
        flight = (key, endpoint, refused)
        attempt = self._attaching.get(flight)
        if attempt is None:
            attempt = asyncio.ensure_future(self._attach(key, endpoint, refused))
            self._attaching[flight] = attempt
            attempt.add_done_callback(lambda done: self._landed(flight, done))
        await asyncio.shield(attempt)  # a caller that leaves does not cancel the others' try

    def _landed(self, flight: tuple[WorkerKey, str, bool], attempt: asyncio.Future[None]) -> None:
        if self._attaching.get(flight) is attempt:
            del self._attaching[flight]
        if not attempt.cancelled():
            attempt.exception()  # retrieved: every caller that waited has raised it already

    async def _attach(self, key: WorkerKey, endpoint: str, refused: bool) -> None:
        async with self._attach_locks[key]:  # one channel change at a time per worker
            if self.streams.connected(key) and self.streams.endpoint_of(key) == endpoint:
                if refused:
                    await self.streams.hello(key)
                return
            await self.streams.connect(key, endpoint, self._channel_keys.get(key[0]))

    async def _attach_all(self, keys: list[WorkerKey]) -> None:
        """Attach to the channels of the workers of ``keys`` not attached (each failure logged:
        the next poll tries again)."""
        missing = [k for k in keys if k in self.identities and not self.streams.connected(k)]
        outcomes = await asyncio.gather(*map(self.attach, missing), return_exceptions=True)
        for key, outcome in zip(missing, outcomes, strict=True):
            if isinstance(outcome, TokenChannelError):
                log.warning("token channel of %s: %s", key, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome

    async def aclose(self) -> None:
        """Close the token channels (their open requests end as lost)."""
        if self._streams is not None:
            await self._streams.aclose()
            self._streams = None

    async def kv_events(
        self, role: str, instance: int, epoch: str, seq: int, wait_s: float
    ) -> KvEventBatch:
        """Worker ``(role, instance)``'s prefix-cache events after (epoch, seq), once there is
        one or ``wait_s`` passed (a long poll)."""
        worker = self.worker(role, instance)
        return await worker.kv_events.remote(epoch, seq, wait_s, self.coordinator_id)

    async def kv_snapshot(self, role: str, instance: int) -> KvSnapshot:
        """Every hash in worker ``(role, instance)``'s prefix cache now."""
        return await self.worker(role, instance).kv_snapshot.remote()

    def _keyed_actors(self) -> list[tuple[tuple[str, int], Any]]:
        pools = self._pools()
        return [
            ((role, i), actor)
            for role, pool in pools.items()
            for i, actor in enumerate(pool)
            if actor is not None
        ]


async def _answer(method: Any, *args: Any) -> Any:
    """An actor ``method``'s answer, None when the actor is dead, restarting or does not answer
    within ``LOAD_TIMEOUT_S``."""
    try:
        return await asyncio.wait_for(method.remote(*args), LOAD_TIMEOUT_S)
    except (TimeoutError, ray.exceptions.RayError):
        return None


def _counterpart(
    keys: ClusterCredentials | None, share: KVCredentials | None
) -> KVCredentials | None:
    return None if keys is None else counterpart(keys, share)
