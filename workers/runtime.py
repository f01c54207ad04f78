"""What every worker actor shares: an engine on its own thread, the requests it holds
(``workers/worker_request.py``), its token channel, and the abort / load methods the cluster
client calls.

Worker actors are threaded Ray actors. A request sent here (``generate``, ``prefill``, or a
decode worker's ``reserve``) is queued on the engine and the call returns; from then on the
engine thread sends each step's events, one message per coordinator, on the worker's token
channel (``workers/token_channel.py``), never blocking: no Ray call per token and no thread per
stream. A request's record lives until its final event went out, or it is aborted. So an idle
worker holds no request: ``load().num_open_streams`` is 0. A coordinator whose messages had to
be dropped (gone, or not reading) has those requests aborted here.

Every request names the coordinator that sent it; a coordinator renews its lease with each
``report`` (its load poll, on a thread group of its own) and with every other call that names it
(a request sent, an abort, a router's long poll), and one whose lease lapsed has all its requests
here aborted
(``workers/leases.py``). ``report`` also hands the coordinator the prefix cache's events after the
last one it saw (``engine/kv_events.py``), from which its router mirrors this worker's cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import ray

from engine.config import EngineConfig
from engine.errors import GrammarError
from engine.kv_events import KvEventBatch, KvSnapshot
from engine.outputs import CONSTRAINT_VIOLATED, TokenEvent
from engine.request import NewRequest
from engine.transfer.security import KVCredentials
from workers.contracts import (
    GenerationRequest,
    HandoffTarget,
    Submitted,
    WorkerIdentity,
    WorkerLoad,
    WorkerReport,
)
from workers.heap import HeapKeeper
from workers.leases import Leases, PlannerLease
from workers.token_channel import TokenSender
from workers.worker_request import WorkerRequests

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
# A worker actor's threads, by Ray concurrency group: the control plane (load polls and lease
# renewals, aborts, identity) never queues behind calls that wait, the long polls of routers
# have their own, and hand-offs waiting for KV room (a decode worker's reserve) are capped well
# under theirs (``MAX_WAITING_RESERVATIONS``); requests sent (generate, prefill) return at once
# on the default group.
# Lease renewals (``report``) have a group of their own, so that no other call, however many
# wait (aborts behind a long step), ever queues one past its lease.
CONTROL, LEASES, LONG_POLLS, HANDOFFS = "control", "leases", "long_polls", "handoffs"
CONCURRENCY_GROUPS = {CONTROL: 16, LEASES: 4, LONG_POLLS: 16, HANDOFFS: 64}
# reserve calls a decode worker lets wait at once; one more is refused at once as the pool being
# full, never queued behind Ray's threads (a coordinator queues its own beyond these:
# coordinator/pool/reserve_queue.py)
MAX_WAITING_RESERVATIONS = CONCURRENCY_GROUPS[HANDOFFS] - 16
LOAD_WAIT_S = 0.5
F = TypeVar("F", bound=Callable[..., Any])


def in_group(group: str) -> Callable[[F], F]:
    """Run a worker actor's method on Ray concurrency group ``group`` (``ray.method``, which
    returns the method itself, marked)."""
    return cast(Callable[[F], F], ray.method(concurrency_group=group))


KV_EVENTS_MAX_WAIT_S = 5.0  # the longest a router's long poll for prefix-cache events waits


class WorkerRuntime:
    role = "worker"

    def __init__(
        self,
        config: EngineConfig,
        instance: int = 0,
        cpu_ids: tuple[int, ...] | None = None,
        channel_host: str = "127.0.0.1",
        channel_credentials: KVCredentials | None = None,
    ) -> None:
        """``cpu_ids``: the cores to pin the process to (None: the OS schedules);
        ``channel_host``, ``channel_credentials``: where the token channel binds and whom it
        admits (without credentials: loopback only)."""
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s %(levelname)s {self.role}[{instance}] %(message)s",
        )
        if cpu_ids:  # own these cores: a prefill and a decode worker never share one
            _pin_process(cpu_ids)
        self.instance = instance
        self.requests = WorkerRequests(self.role)  # every request here (workers/worker_request.py)
        self.leases = Leases()  # the coordinators sending requests here (workers/leases.py)
        self.planner_lease = PlannerLease()  # which coordinator plans roles (the first worker's)
        self.channel = TokenSender(channel_host, channel_credentials)
        self.heap = HeapKeeper()  # figures and trims of the C heap (workers/heap.py)
        # the engine's modules (torch) load here, in the worker: a coordinator names this class
        # to start workers without loading them
        from engine.engine_loop import EngineLoop
        from engine.llm_engine import LLMEngine

        # built on the engine thread: the one thread here that runs OpenMP teams (engine/openmp.py)
        self.loop = EngineLoop(lambda: LLMEngine(config), self)
        self.engine = self.loop.engine

    # ---- engine hooks (engine/engine_loop.py), on the engine thread -----------------------------

    def on_housekeeping(self) -> None:
        """Abort the requests of coordinators whose lease lapsed, and those whose events the
        token channel had to drop (on a thread of their own: an abort waits for this engine
        thread); keep the C heap (its figures, a trim now and then)."""
        self.heap.tick()
        doomed = []
        for owner in self.leases.take_expired():
            self.channel.forget(owner)
            owned = self.requests.owned_by(owner)
            log.warning("coordinator %s's lease lapsed: %d requests aborted", owner, len(owned))
            doomed.extend(owned)
        for owner, lagging in self.channel.take_lagging().items():
            log.warning("coordinator %s is not reading: %d requests aborted", owner, len(lagging))
            doomed.extend(lagging)
        if doomed:
            threading.Thread(target=self._abort_all, args=(doomed,), daemon=True).start()

    def _abort_all(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            try:
                self.abort(request_id)
            except Exception:  # one failed abort must not keep the others
                log.exception("abort of %s failed", request_id)

    def on_events(self, events: list[TokenEvent]) -> None:
        """Send the step's events, one message to each coordinator."""
        self.channel.send_step(self._by_owner(events))

    def _by_owner(self, events: list[TokenEvent]) -> dict[str, list[TokenEvent]]:
        """``events`` grouped by their requests' coordinators (those of requests no longer
        held here dropped); a request whose final event this is is no longer held."""
        by_owner: dict[str, list[TokenEvent]] = defaultdict(list)
        for event, owner in zip(events, self.requests.route(events), strict=True):
            if owner is not None:
                by_owner[owner].append(event)
        return by_owner

    def engine_request(
        self,
        request: GenerationRequest,
        max_output_tokens: int | None = None,
        disaggregated: bool = False,
        **fields: Any,
    ) -> NewRequest:
        """``request`` as this worker's engine takes it: decoding to ``max_output_tokens`` when
        the coordinator set it, else to the colocated (or ``disaggregated``) limit of
        ``engine.token_accounting``; ``fields``: the engine's own (arrival time, prefill-only)."""
        if max_output_tokens:
            fields["max_output_tokens"] = max_output_tokens
        return self.engine.request(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            disaggregated,
            output_token_ids=request.output_token_ids,
            priority=request.priority,
            tenant=request.tenant,
            client=request.client,
            cache_key=request.cache_key,
            **fields,
        )

    def _submit(
        self,
        request: GenerationRequest,
        handoff: HandoffTarget | None = None,
        prefill_only: bool = False,
        max_output_tokens: int | None = None,
    ) -> Submitted:
        """Queue ``request`` on the engine (its events go on the token channel), or say why
        not. ``handoff``: where a prefill worker sends its KV once held; ``prefill_only``,
        ``max_output_tokens``: see :class:`NewRequest` (by default the colocated limit)."""
        if not self.channel.is_attached(request.owner):
            return Submitted.unattached(self.channel.endpoint)
        if request.request_id in self.requests:
            return Submitted(False, f"request id {request.request_id!r} is already in use")
        self.leases.renew(request.owner)
        # its wait for the engine thread counts as queueing too
        new = self.engine_request(
            request, max_output_tokens, arrival_time=time.monotonic(), prefill_only=prefill_only
        )
        self.requests.open(request.request_id, request.owner, handoff)

        def queue_it(engine: LLMEngine) -> None:
            # an abort that ran first on this thread closed the record: nothing to queue (a
            # prefill would be held for a hand-off no one takes)
            if request.request_id in self.requests:
                engine.add_request(new)

        try:
            # a constraint compiles here, on the caller's thread: the engine thread finds it cached
            self.engine.grammars.compile(request.params.constraint)
            self.loop.call(queue_it).result()
        except Exception as exc:
            self.requests.close(request.request_id)
            cause = CONSTRAINT_VIOLATED if isinstance(exc, GrammarError) else "engine_error"
            return Submitted(False, str(exc), cause=cause)
        return Submitted(True, channel=self.channel.endpoint)

    # ---- methods the client calls --------------------------------------------------------------

    @in_group(CONTROL)
    def ready(self) -> WorkerIdentity:
        from engine.kernels import kernel_origins
        from engine.kernels.quantized import quantized_kernels

        quantized = quantized_kernels()  # loaded first, so that kernel_origins() lists it
        return WorkerIdentity(
            self.role,
            self.instance,
            os.getpid(),
            tuple(sorted(os.sched_getaffinity(self.loop.native_id))),
            self.engine.model_name,
            self.engine.layout.to_dict(),
            _ray_node_ip(),
            self.engine.model.describe(),
            kernel_origins(),
            self.engine.model.weight_formats(),
            quantized.isa() if quantized is not None else "",  # its instruction set
            self.channel.endpoint,
        )

    @in_group(CONTROL)
    def abort(self, request_id: str, owner: str = "") -> bool:
        """End ``request_id`` here: its abort event, sent at the next step, ends its record
        (and its coordinator's stream); one the engine does not hold (finished, or sent but
        not queued yet: it never will be) is forgotten at once, an abort event sent for it if
        it was still held here. On the engine thread, so no step sends in between. ``owner``,
        the coordinator asking, renews its lease."""
        self.leases.renew(owner)

        def abort(engine: LLMEngine) -> bool:
            return engine.abort(request_id) or self._forget(request_id)

        return self.loop.call(abort).result()

    def _forget(self, request_id: str) -> bool:
        """Drop the record of ``request_id`` that the engine does not hold, telling its
        coordinator that it ended (aborted); whether there was one."""
        owner = self.requests.close(request_id)
        if owner is not None:
            self.channel.send_step({owner: [TokenEvent.aborted(request_id)]})
        return owner is not None

    @in_group(LEASES)
    def report(self, owner: str, kv_epoch: str = "", kv_seq: int = -1) -> WorkerReport:
        """The load poll of coordinator ``owner``: renews its lease, and returns this worker's
        load with the prefix cache's events after ``kv_seq`` of ``kv_epoch`` (a gap, when they
        are gone or the epoch is not this engine's: the caller then asks ``kv_snapshot``)."""
        self.leases.renew(owner)
        events: KvEventBatch = self.engine.blocks.events.since(kv_epoch, kv_seq)
        return WorkerReport(self.load(), events, len(self.leases.live()))

    @in_group(CONTROL)
    def claim_planner(self, owner: str, ttl_s: float) -> bool:
        """Take or renew the role planner's lease for coordinator ``owner`` (workers/leases.py);
        False while another coordinator holds it."""
        return self.planner_lease.claim(owner, ttl_s)

    @in_group(LONG_POLLS)
    def kv_events(self, kv_epoch: str, kv_seq: int, wait_s: float, owner: str = "") -> KvEventBatch:
        """The prefix cache's events after ``kv_seq`` of ``kv_epoch`` once there is one, waiting
        up to ``wait_s`` (at most ``KV_EVENTS_MAX_WAIT_S``) for it: a router's long poll.
        ``owner``, the coordinator asking, renews its lease."""
        self.leases.renew(owner)
        wait_s = min(max(0.0, float(wait_s)), KV_EVENTS_MAX_WAIT_S)
        return self.engine.blocks.events.wait_since(kv_epoch, kv_seq, wait_s)

    @in_group(CONTROL)
    def kv_snapshot(self) -> KvSnapshot:
        """Every hash in the prefix cache, taken on the engine thread (so exactly as of the
        latest event)."""
        return self.loop.call(lambda e: e.blocks.kv_snapshot()).result()

    @in_group(CONTROL)
    def live_coordinators(self) -> list[str]:
        """The coordinators whose lease here has not lapsed."""
        return self.leases.live()

    @in_group(CONTROL)
    def load(self) -> WorkerLoad:
        """The engine's figures now, or, when the engine thread is in a step longer than
        ``LOAD_WAIT_S``, as of its last step: a load poll never waits for a long prefill."""
        future = self.loop.call(lambda e: e.stats())
        try:
            stats = future.result(timeout=LOAD_WAIT_S)
        except TimeoutError:
            future.cancel()
            stats = self.loop.stats
        return WorkerLoad(
            self.role,
            self.instance,
            os.getpid(),
            stats,
            len(self.requests),
            self.leases.num_expired,
            self.requests.count_by_owner(),
            self.channel.num_dropped_events,
            self.heap.figures,
        )

    def close(self) -> None:
        """Stop the engine thread and close the token channel (tests; an actor's process
        ends with it)."""
        self.loop.stop()
        self.channel.close()


def _ray_node_ip() -> str:
    """The address of the Ray node this worker runs on; "" when it runs outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else ""


def _pin_process(cpu_ids: tuple[int, ...]) -> None:
    """Set the affinity of every thread of this process; threads started later inherit it."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task), cpu_ids)
