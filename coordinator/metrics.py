"""Prometheus metrics with MindIE Server's names, on the external port's ``GET /metrics``.

Worker figures come from the loads the router polls: gauges take the latest value; the prefix
cache's token counts, cumulative on each worker since it started, feed counters through
:class:`PolledCounter`, so a restarted worker never makes a counter go backwards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.polled_counter import PolledCounter
from coordinator.pool.prefix_pull import PullOutcome
from coordinator.pull_metrics import PullMetrics
from coordinator.role_metrics import RoleMetrics
from coordinator.tier_metrics import TierMetrics
from engine.grammars import GrammarCache
from engine.outputs import EngineStats
from workers.contracts import WorkerLoad, WorkerReport

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
# Why a request migrated (TokenEvent.cause of its pair's error event): each series exists from
# the start, at zero, so rate() and alerts see it before the first migration.
MIGRATION_CAUSES = ("worker_lost", "handoff_failed", "reservation_refused", "engine_error")
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
WORKER = ("role", "instance")  # the labels of a worker's series, besides the model's name
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "lark")


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._declare_requests()
        self._declare_workers()
        self._declare_transfers()
        self._declare_latencies()
        self._declare_grammars()
        self._speculating = False  # its families are declared once a worker speculates
        self._pulls: PullMetrics | None = None  # peer prefix pulls' once one was made
        self.roles: RoleMetrics | None = None  # elastic workers' once a poll reports one
        self._tiers: TierMetrics | None = None  # ... and the KV tiers' once a worker has tiers
        self._declare_replicas()

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        return Counter(name, documentation, ["model_name", *labels], registry=self.registry)

    def _gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        return Gauge(name, documentation, ["model_name", *labels], registry=self.registry)

    def _polled(self, name: str, documentation: str) -> PolledCounter:
        """A counter of each worker's, fed with the figure the worker counts itself."""
        return PolledCounter(self._counter(name, documentation, *WORKER))

    def _histogram(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
        labels: tuple[str, ...] = (),
    ) -> Histogram:
        return Histogram(
            name, documentation, ["model_name", *labels], buckets=buckets, registry=self.registry
        )

    def _declare_requests(self) -> None:
        self.received = self._counter("request_received", "Requests received")
        self.success = self._counter("request_success", "Requests finished")
        self.failed = self._counter("request_failed", "Requests failed, by reason", "reason")
        self.migrations = self._counter(
            "request_migrations",
            "Requests moved to another worker pair with their tokens so far, by cause",
            "reason",
        )
        for cause in MIGRATION_CAUSES:
            self.migrations.labels(self.model_name, cause)
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens")
        self.running = self._gauge("num_requests_running", "Requests streaming tokens")
        self.slow_clients = self._counter(
            "slow_client_aborts",
            "Requests aborted because their client left too many token events unread",
        )
        self.slow_clients.labels(self.model_name)  # exported at 0 before the first one
        self.waiting = self._gauge("num_requests_waiting", "Requests before their first token")

    def _declare_workers(self) -> None:
        self.npu_cache = self._gauge("npu_cache_usage_perc", "KV cache in use (0-1)", *WORKER)
        self.kv_cache = self._gauge("kv_cache_usage_perc", "KV cache in use (0-1)", *WORKER)
        self.queue_depth = self._gauge(
            "worker_num_requests_waiting", "Requests queued on a worker", *WORKER
        )
        self.batch_size = self._gauge(
            "worker_num_requests_running", "Requests in a worker's batch", *WORKER
        )
        self.cached_blocks = self._gauge(
            "worker_num_cached_blocks", "KV blocks of a worker holding reusable prefix KV", *WORKER
        )
        self.heap_in_use = self._gauge(
            "worker_heap_in_use_bytes", "Bytes of a worker's C heap in use (glibc)", *WORKER
        )
        self.heap_free = self._gauge(
            "worker_heap_free_bytes", "Free bytes a worker's C heap holds (glibc)", *WORKER
        )
        self.prefix_cache_queries = self._polled(
            "prefix_cache_queries", "Prompt tokens a worker looked up in its prefix cache"
        )
        self.token_events_dropped = self._polled(
            "token_events_dropped",
            "Token events a worker's channel could not send to a coordinator (gone, or not "
            "reading): their requests were aborted",
        )
        self.prefix_cache_hits = self._polled(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (KV not computed; on decode: not sent)",
        )

    def _declare_transfers(self) -> None:
        self.kv_transfer_bytes = self._counter(
            "kv_transfer_bytes", "KV bytes moved from prefill to decode"
        )
        self.kv_transfers = self._counter(
            "kv_transfers",
            "KV hand-offs by the path their pages took (shared_memory, frames, chunks)",
            "path",
        )
        self.kv_transfer_seconds = self._histogram(
            "kv_transfer_seconds",
            "Time to move a request's KV pages from prefill to decode",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )

    def _declare_latencies(self) -> None:
        self.queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time a prompt waited on the engine computing it (role: prefill, decode or "
            "colocated) before its first chunk ran",
            labels=("role",),
        )
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Time from a prompt's first chunk to its first token, on the engine computing it",
            labels=("role",),
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token")
        self.tpot = self._histogram("time_per_output_token_seconds", "Time per output token")
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.request_prompt = self._histogram(
            "request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS
        )
        self.request_generation = self._histogram(
            "request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        )

    def _declare_grammars(self) -> None:
        self.constrained = self._counter(
            "constrained_requests", "Requests whose output must match a constraint", "kind"
        )
        for kind in CONSTRAINT_KINDS:
            self.constrained.labels(self.model_name, kind)
        self.grammar_compile = self._histogram(
            "grammar_compile_seconds",
            "Time to compile a constraint not in the door's cache (a worker's compile costs alike)",
            COMPILE_BUCKETS,
        )
        self.grammar_cache_hits = self._counter(
            "grammar_cache_hits", "Constraints the door found compiled already"
        )
        self._door_hits = 0
        self.grammar_cache_size = self._gauge(
            "worker_grammar_cache_size", "Compiled constraints a worker keeps", *WORKER
        )
        self.grammar_masked_rows = self._polled(
            "grammar_masked_rows", "Constrained rows a worker masked"
        )
        self.grammar_mask_seconds = self._polled(
            "grammar_mask_seconds", "Seconds a worker spent masking constrained rows"
        )

    def _declare_speculation(self) -> None:
        """Speculative decoding's figures (engine/speculation.py), as each worker counts them:
        declared when the first worker reports a check, so a service that does not speculate
        exports no empty families of them."""
        self._speculating = True
        self.speculative_checks = self._polled(
            "speculative_checks", "Drafts a worker checked against the model"
        )
        self.speculative_drafted = self._polled(
            "speculative_drafted_tokens", "Tokens a worker drafted and checked"
        )
        self.speculative_accepted = self._polled(
            "speculative_accepted_tokens", "Drafted tokens the model's own tokens matched"
        )
        self.speculative_by_accepted = PolledCounter(
            self._counter(
                "speculative_checks_by_accepted",
                "Drafts a worker checked, by how many of their tokens were accepted",
                *WORKER,
                "accepted",
            )
        )

    def _record_speculation(self, labels: tuple[str, ...], pid: int, stats: EngineStats) -> None:
        self.speculative_checks.observe(labels, pid, stats.speculative_checks)
        self.speculative_drafted.observe(labels, pid, stats.speculative_drafted)
        self.speculative_accepted.observe(labels, pid, stats.speculative_accepted)
        for accepted, checks in enumerate(stats.speculative_accepted_histogram):
            self.speculative_by_accepted.observe((*labels, str(accepted)), pid, checks)

    def record_grammars(self, door: GrammarCache | None) -> None:
        """The door's compiles since the last scrape, and its cache hits."""
        if door is None:
            return
        for seconds in door.stats.take_seconds():
            self.grammar_compile.labels(self.model_name).observe(seconds)
        hits, self._door_hits = door.stats.hits - self._door_hits, door.stats.hits
        self.grammar_cache_hits.labels(self.model_name).inc(max(hits, 0))

    def record_finished(
        self, prompt_tokens: int, output_tokens: int, ttft: float | None, e2e: float
    ) -> None:
        name = self.model_name
        self.success.labels(name).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.request_prompt.labels(name).observe(prompt_tokens)
        self.request_generation.labels(name).observe(output_tokens)
        self.e2e.labels(name).observe(e2e)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
            if output_tokens > 1:
                self.tpot.labels(name).observe((e2e - ttft) / (output_tokens - 1))

    def record_prefill(self, role: str, queued_s: float, prefill_s: float) -> None:
        """Where a prompt's time to first token went on the engine that computed it."""
        self.queue_time.labels(self.model_name, role).observe(max(queued_s, 0.0))
        self.prefill_time.labels(self.model_name, role).observe(max(prefill_s, 0.0))

    def record_handoff(self, num_bytes: int, seconds: float, path: str = "") -> None:
        """One KV hand-off that reached its decode worker, by the ``path`` its pages took."""
        self.kv_transfer_seconds.labels(self.model_name).observe(seconds)
        self.kv_transfer_bytes.labels(self.model_name).inc(num_bytes)
        self.kv_transfers.labels(self.model_name, path or "unknown").inc()

    def record_pull(self, outcome: PullOutcome) -> None:
        """One peer prefix pull, whatever its outcome (the families declared at the first)."""
        if self._pulls is None:
            self._pulls = PullMetrics(self.registry, self.model_name)
        self._pulls.record(outcome)

    def role_metrics(self) -> RoleMetrics:
        """The elastic workers' families, declared at the first use."""
        if self.roles is None:
            self.roles = RoleMetrics(self.registry, self.model_name)
        return self.roles

    def record_loads(self, loads: list[WorkerLoad]) -> None:
        if any(load.role_state is not None for load in loads):
            self.role_metrics().record_loads(loads)
        for load in loads:
            labels = (self.model_name, load.role, str(load.instance))
            self.npu_cache.labels(*labels).set(load.stats.kv_usage)
            self.kv_cache.labels(*labels).set(load.stats.kv_usage)
            self.queue_depth.labels(*labels).set(load.stats.num_waiting)
            self.batch_size.labels(*labels).set(load.stats.num_running)
            self.cached_blocks.labels(*labels).set(load.stats.num_cached_blocks)
            self.heap_in_use.labels(*labels).set(load.heap.in_use_bytes)
            self.heap_free.labels(*labels).set(load.heap.free_bytes)
            self.prefix_cache_queries.observe(labels, load.pid, load.stats.prefix_cache_queries)
            self.prefix_cache_hits.observe(labels, load.pid, load.stats.prefix_cache_hits)
            self.token_events_dropped.observe(labels, load.pid, load.num_dropped_events)
            stats = load.stats
            self.grammar_cache_size.labels(*labels).set(stats.grammar_cache_size)
            self.grammar_masked_rows.observe(labels, load.pid, stats.grammar_masked_rows)
            self.grammar_mask_seconds.observe(labels, load.pid, stats.grammar_mask_seconds)
            if stats.speculative_checks:
                if not self._speculating:
                    self._declare_speculation()
                self._record_speculation(labels, load.pid, stats)
            if stats.kv_tiers:
                if self._tiers is None:
                    self._tiers = TierMetrics(self.registry, self.model_name)
                self._tiers.record(labels, load.pid, stats)

    def _declare_replicas(self) -> None:
        """What several coordinators over one worker pool add (docs/replicas.md)."""
        self.coordinator_info = self._gauge(
            "coordinator_info",
            "1, labelled with this coordinator's id (its lease owner)",
            "coordinator",
        )
        self.kv_events = self._counter(
            "kv_events_received", "Prefix-cache events of the workers this router applied"
        )
        self.kv_resyncs = self._counter(
            "kv_index_resyncs",
            "Snapshots of a worker's prefix cache loaded after a gap in its events or a restart",
        )
        self.leases_expired = self._polled(
            "worker_leases_expired",
            "Coordinators whose lease on a worker lapsed (their requests there aborted)",
        )
        self.worker_coordinators = self._gauge(
            "worker_num_coordinators",
            "Coordinators holding a live lease on a worker",
            *WORKER,
        )
        self._kv_seen = (0, 0)

    def record_replicas(
        self, coordinator_id: str, reports: list[WorkerReport], num_events: int, num_resyncs: int
    ) -> None:
        """This coordinator's id, its router's event and resync totals, and each worker's
        leases, from the latest load poll."""
        self.coordinator_info.labels(self.model_name, coordinator_id).set(1)
        events, resyncs = self._kv_seen
        self.kv_events.labels(self.model_name).inc(max(num_events - events, 0))
        self.kv_resyncs.labels(self.model_name).inc(max(num_resyncs - resyncs, 0))
        self._kv_seen = (num_events, num_resyncs)
        for report in reports:
            load = report.load
            labels = (self.model_name, load.role, str(load.instance))
            self.leases_expired.observe(labels, load.pid, load.num_leases_expired)
            self.worker_coordinators.labels(*labels).set(report.num_coordinators)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
