"""Prometheus metrics with MindIE Server's names, on the external port's ``GET /metrics``.

Worker figures come from the loads the router polls: gauges take the latest value; the prefix
cache's token counts, cumulative on each worker since it started, feed counters through
:class:`PolledCounter`, so a restarted worker never makes a counter go backwards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from workers.contracts import WorkerLoad

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


class PolledCounter:
    """A counter per worker fed with a figure the worker counts up itself: each figure seen adds
    what it gained over the one seen before. A worker with a new pid restarted and counts from zero,
    so its whole figure is added; a lower figure from the same process (a load answered with the
    stats of an earlier engine step) adds nothing until the figure passes the last one again."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._last: dict[tuple[str, ...], tuple[int, int]] = {}  # labels -> (pid, figure)

    def observe(self, labels: tuple[str, ...], pid: int, figure: int) -> None:
        last_pid, last = self._last.get(labels, (pid, 0))
        base = last if pid == last_pid else 0
        self.counter.labels(*labels).inc(max(figure - base, 0))
        self._last[labels] = (pid, max(figure, base))


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.received = Counter("request_received", "Requests received", m, registry=r)
        self.success = Counter("request_success", "Requests finished", m, registry=r)
        self.failed = Counter(
            "request_failed", "Requests failed, by reason", [*m, "reason"], registry=r
        )
        self.migrations = Counter(
            "request_migrations",
            "Requests moved to another worker pair with their tokens so far, by cause",
            [*m, "reason"],
            registry=r,
        )
        for cause in MIGRATION_CAUSES:
            self.migrations.labels(model_name, cause)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens", m, registry=r)
        self.generation_tokens = Counter("generation_tokens", "Generated tokens", m, registry=r)
        self.running = Gauge("num_requests_running", "Requests streaming tokens", m, registry=r)
        self.waiting = Gauge(
            "num_requests_waiting", "Requests before their first token", m, registry=r
        )
        worker = [*m, "role", "instance"]
        self.npu_cache = Gauge("npu_cache_usage_perc", "KV cache in use (0-1)", worker, registry=r)
        self.kv_cache = Gauge("kv_cache_usage_perc", "KV cache in use (0-1)", worker, registry=r)
        self.queue_depth = Gauge(
            "worker_num_requests_waiting", "Requests queued on a worker", worker, registry=r
        )
        self.batch_size = Gauge(
            "worker_num_requests_running", "Requests in a worker's batch", worker, registry=r
        )
        self.cached_blocks = Gauge(
            "worker_num_cached_blocks",
            "KV blocks of a worker holding reusable prefix KV",
            worker,
            registry=r,
        )
        self.prefix_cache_queries = PolledCounter(
            Counter(
                "prefix_cache_queries",
                "Prompt tokens a worker looked up in its prefix cache",
                worker,
                registry=r,
            )
        )
        self.prefix_cache_hits = PolledCounter(
            Counter(
                "prefix_cache_hits",
                "Prompt tokens found in the prefix cache (KV not computed; on decode: not sent)",
                worker,
                registry=r,
            )
        )
        self.kv_transfer_bytes = Counter(
            "kv_transfer_bytes", "KV bytes moved from prefill to decode", m, registry=r
        )
        self.kv_transfers = Counter(
            "kv_transfers",
            "KV hand-offs by the path their pages took (shared_memory, frames, chunks)",
            [*m, "path"],
            registry=r,
        )
        self.kv_transfer_seconds = self._histogram(
            "kv_transfer_seconds",
            "Time to move a request's KV pages from prefill to decode",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
        )
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

    def record_loads(self, loads: list[WorkerLoad]) -> None:
        for load in loads:
            labels = (self.model_name, load.role, str(load.instance))
            self.npu_cache.labels(*labels).set(load.stats.kv_usage)
            self.kv_cache.labels(*labels).set(load.stats.kv_usage)
            self.queue_depth.labels(*labels).set(load.stats.num_waiting)
            self.batch_size.labels(*labels).set(load.stats.num_running)
            self.cached_blocks.labels(*labels).set(load.stats.num_cached_blocks)
            self.prefix_cache_queries.observe(labels, load.pid, load.stats.prefix_cache_queries)
            self.prefix_cache_hits.observe(labels, load.pid, load.stats.prefix_cache_hits)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
