"""What crosses process boundaries between the coordinator and the worker actors (over Ray).

Every type here is a frozen dataclass that Ray pickles as itself: callers read attributes, never
string keys, and a field added on one side is seen by the other.

    coordinator ──GenerationRequest──► DecodeWorker.reserve ──► Reservation
    coordinator ──GenerationRequest + HandoffTarget──► PrefillWorker.prefill ──► Submitted
    coordinator ──GenerationRequest──► ColocatedWorker.generate ──► Submitted

A request's events do not come back over Ray: each worker sends every engine step's events to
the coordinators on its token channel (``workers/token_channel.py``), a prefill's
:class:`HandoffResult` after its first token. A call whose coordinator is not attached to that
channel is refused with the channel's endpoint (``Submitted.unattached``, a reservation with
``channel`` set): the coordinator connects and calls again.
    coordinator ──► WorkerRuntime.ready ──► WorkerIdentity (at start, and after a restart)
    coordinator ──► WorkerRuntime.load ──► WorkerLoad
    coordinator ──owner, KV event cursor──► WorkerRuntime.report ──► WorkerReport
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.kv_events import KvEventBatch
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from workers.heap import HeapFigures

# the cause of a request an elastic worker gave up because it changed roles (or was asked in a
# role or epoch it no longer serves): it goes to another worker, spending none of its retries
ROLE_SWITCH = "role_switch"


@dataclass(frozen=True)
class RoleState:
    """An elastic worker's role (``elastic_worker/worker.py``): the one it serves, its epoch
    (bumped by each switch), whether a switch is under way (it takes no new work then), and its
    engine steps since it took this role (the first ones run cold)."""

    serving: str
    epoch: int = 0
    switching: bool = False
    steps_in_role: int = 0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as a front door asks for it."""

    request_id: str
    prompt_token_ids: Sequence[int]  # stored as a tuple
    params: SamplingParams
    priority: int = 5  # 1 is served first
    timeout_s: float = 600.0  # the client's own limit for the whole request; 0 = none
    # Tokens the request already generated and streamed on a worker pair that failed: the next
    # pair computes them with the prompt and continues after them (stored as a tuple).
    output_token_ids: Sequence[int] = ()
    # Whose prompt it is (coordinator.api.tenants: a keyed hash of the client's API key, never
    # the key): every worker roots its prefix-cache hashes in it, and so does the router, so one
    # tenant's requests never hit another's cached blocks. "": no tenant (one shared cache).
    tenant: str = ""
    # Whose request it is (coordinator.api.clients: a keyed hash of its API key, or of its
    # address): each engine's waiting queue takes clients in turn within a priority.
    client: str = ""
    # A conversation's key (OpenAI's prompt_cache_key, the X-Prompt-Cache-Key header at every
    # door; a hash of it): the workers keep its blocks longer (kv_session_ttl_s). "": none.
    cache_key: str = ""
    # The coordinator that sent it: if that coordinator's lease on a worker lapses, the worker
    # aborts it (workers/leases.py). "": no coordinator (never aborted for a lease).
    owner: str = ""

    def __post_init__(self) -> None:
        for name in ("prompt_token_ids", "output_token_ids"):
            if not isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and outputs so far: what a worker pair computes before its first new token."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def continued(self, request_id: str, output_token_ids: Sequence[int]) -> GenerationRequest:
        """The same request under another id, continuing after ``output_token_ids`` (a
        migration to another worker pair)."""
        return replace(self, request_id=request_id, output_token_ids=tuple(output_token_ids))


@dataclass(frozen=True)
class HandoffTarget:
    """Where a prefill worker pushes a request's KV, and how far the decode worker takes it."""

    endpoint: str  # the decode worker's KV endpoint, from its Reservation
    max_output_tokens: int  # output limit, first token included (docs/token-accounting.md)
    token: str = field(default="", repr=False)  # the Reservation's secret, sent with the pages
    first_block: int = 0  # the Reservation's num_cached_blocks: pages before it are not sent

    @classmethod
    def nowhere(cls, max_output_tokens: int) -> HandoffTarget:
        """No hand-off: the request ends on the prefill worker's first token, its limit."""
        return cls("", max_output_tokens)

    @property
    def hands_off(self) -> bool:
        """Whether pages go somewhere (a reservation's endpoint), not :meth:`nowhere`."""
        return bool(self.endpoint)

    @classmethod
    def from_reservation(cls, reservation: Reservation, max_output_tokens: int) -> HandoffTarget:
        """Where and from which block to push the pages a decode worker reserved room for."""
        return cls(
            reservation.endpoint,
            max_output_tokens,
            reservation.token,
            reservation.num_cached_blocks,
        )


@dataclass(frozen=True)
class Reservation:
    """A decode worker's answer to ``reserve``: blocks set aside, the endpoint to push the
    pages to and the reservation's secret (only pages carrying it are accepted: only the
    coordinator and the prefill worker it picks may learn it), or the reason it refused."""

    granted: bool
    endpoint: str = ""
    reason: str = ""
    token: str = field(default="", repr=False)
    # leading blocks of the request the decode worker's prefix cache holds: only the rest is sent
    num_cached_blocks: int = 0
    channel: str = ""  # refused because its coordinator is not attached to this token channel
    # refused for want of room: every block taken for as long as it could wait, or as many
    # hand-offs already waiting as the worker lets wait (the pool is full now; not a fault)
    full: bool = False
    restarting: bool = False  # never reached the worker: Ray is restarting its actor
    # refused for want of room: when the worker expects room for it (0: no estimate)
    retry_after_s: float = 0.0
    cause: str = ""  # a refusal's kind when it is none of the above (``role_switch``)

    @classmethod
    def refused(cls, reason: str) -> Reservation:
        return cls(False, reason=reason)

    @classmethod
    def no_room(cls, reason: str, retry_after_s: float = 0.0) -> Reservation:
        return cls(False, reason=reason, full=True, retry_after_s=retry_after_s)

    @classmethod
    def unattached(cls, channel: str) -> Reservation:
        return cls(False, reason=f"not attached to the token channel at {channel}", channel=channel)

    @classmethod
    def moved(cls, reason: str) -> Reservation:
        """Refused because the worker serves another role now (``workers/role_gate.py``): no
        fault of the request, which goes to another worker."""
        return cls(False, reason=reason, cause=ROLE_SWITCH)


@dataclass(frozen=True)
class Submitted:
    """A worker's answer to a request sent to it (``generate``, ``prefill``): queued (its
    events follow on the token channel), refused with the ``error`` its stream ends with (and
    that failure's ``cause``), or not taken because its coordinator is not attached to the token
    channel at ``channel``."""

    accepted: bool
    error: str = ""
    channel: str = ""
    cause: str = "engine_error"

    @classmethod
    def unattached(cls, channel: str) -> Submitted:
        return cls(False, channel=channel)


@dataclass(frozen=True)
class HandoffResult:
    """The prefill side's last word on a request: its KV reached the decode worker, or not."""

    request_id: str
    ok: bool
    error: str | None = None
    num_bytes: int = 0
    transfer_seconds: float = 0.0
    path: str = ""  # the path the pages took (engine.transfer.PATHS)


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker is for its process's life: its ``ready`` answer, which the coordinator asks
    at start and again when the worker's pid changes (its actor restarted)."""

    role: str
    instance: int
    pid: int
    cpus: tuple[int, ...] = ()  # the cores its engine thread may run on
    model: str = ""
    layout: dict[str, Any] = field(default_factory=dict)  # its KV layout (KVLayout.to_dict)
    node_ip: str = ""  # the address of the Ray node it runs on ("" outside Ray)
    weights: str = ""  # the weights and kernels its engine computes with (LlamaModel.describe)
    # native module (by source) -> "cached" (imported from an earlier build) or "built" (compiled
    # by this process): a restarted worker comes up on the cached build
    kernels: dict[str, str] = field(default_factory=dict)
    # tensor group -> its format (LlamaModel.weight_formats), and the instruction set the native
    # kernels run ("avx512", "avx2", "scalar"; "" without them)
    weight_formats: dict[str, str] = field(default_factory=dict)
    kernel_isa: str = ""
    token_channel: str = ""  # the endpoint of its token channel (workers/token_channel.py)

    def describe(self) -> dict[str, Any]:
        """What ``pdserve workers`` prints of it: role, instance, pid, cores, model, KV layout."""
        described = ("role", "instance", "pid", "cpus", "model", "layout")
        return {k: v for k, v in asdict(self).items() if k in described}


@dataclass(frozen=True)
class EmbedderIdentity:
    """The embedding worker's ``ready`` answer."""

    role: str
    pid: int
    model: str
    dimensions: int

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's engine figures now, as the router and ``/v1/instances`` see them."""

    role: str
    instance: int
    pid: int
    stats: EngineStats
    num_open_streams: int = 0  # per-request event queues the worker holds (0 once idle)
    num_leases_expired: int = 0  # coordinators whose requests this worker aborted (lease lapsed)
    requests_by_owner: dict[str, int] = field(default_factory=dict)  # coordinator id -> held
    num_dropped_events: int = 0  # events its token channel could not send (a coordinator lagging)
    heap: HeapFigures = field(default_factory=HeapFigures)  # its C heap (workers/heap.py)
    # an elastic worker's role, epoch and switch (None for the others: they serve their ``role``)
    role_state: RoleState | None = None

    @property
    def serving(self) -> str:
        """The role this worker takes requests of now (an elastic one's current role)."""
        return self.role_state.serving if self.role_state is not None else self.role

    def to_dict(self, identity: WorkerIdentity) -> dict[str, Any]:
        """Flat JSON: role, instance, every EngineStats figure, used blocks, open streams, pid,
        and from ``identity`` node address, weights, kernels, their formats and instruction set,
        its token channel's endpoint;
        lapsed leases, the requests held per coordinator, and its C heap's figures."""
        return {
            "role": self.role,
            "instance": self.instance,
            "serving": self.serving,
            "role_epoch": self.role_state.epoch if self.role_state else 0,
            "switching": self.role_state.switching if self.role_state else False,
            **asdict(self.stats),
            "num_used_blocks": self.stats.num_used_blocks,
            "num_open_streams": self.num_open_streams,
            "pid": self.pid,
            "node_ip": identity.node_ip,
            "weights": identity.weights,
            "kernels": dict(identity.kernels),
            "weight_formats": dict(identity.weight_formats),
            "kernel_isa": identity.kernel_isa,
            "token_channel": identity.token_channel,
            "num_leases_expired": self.num_leases_expired,
            "requests_by_owner": dict(self.requests_by_owner),
            "num_dropped_events": self.num_dropped_events,
            "heap_in_use_bytes": self.heap.in_use_bytes,
            "heap_free_bytes": self.heap.free_bytes,
            "heap_trims": self.heap.trims,
            "heap_last_trim_ms": self.heap.last_trim_ms,
        }


@dataclass(frozen=True)
class WorkerReport:
    """A worker's answer to a coordinator's poll: its load, its prefix cache's events since the
    coordinator's last poll (``engine.kv_events``), and how many coordinators hold a lease on it."""

    load: WorkerLoad
    kv_events: KvEventBatch
    num_coordinators: int = 0
