"""Engine configuration: one frozen dataclass per concern, validated at construction.

The names in comments are the MindIE Server ``config.json`` keys each field mirrors. A field
made with :func:`bounded`, :func:`choice` or :func:`flag` carries what it allows (a range,
choices, a bool), which its dataclass checks and which the coordinator's configuration schema
reads, with the default, from the field itself.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a dtype or device is resolved: a coordinator
    import torch  # reads this configuration and never loads torch

_DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPES = ("auto", *_DTYPE_NAMES)
WEIGHT_DTYPES = ("auto", "fp32", "int8", "int4")
# what a quantized layer multiplies a prompt in (model/linear.py)
PROMPT_MATMUL_DTYPES = ("auto", "float32", "bfloat16")
# what quantized layers multiply decode rows with (engine/kernels/isa.py)
ACTIVATION_DTYPES = ("auto", "int8", "float32")
# what the paged KV cache stores keys and values in (auto: the model's dtype, resolve_kv_dtype)
KV_CACHE_DTYPES = ("auto", *_DTYPE_NAMES)
TRANSPORTS = ("zmq", "grpc", "inprocess")  # engine.transfer's transports, by name
ENCRYPTION_MODES = ("auto", "on", "off")
SPECULATIVE_METHODS = ("off", "ngram")  # engine/speculation.py


def bounded(default: int | None, low: int, high: int, name: str) -> Any:
    """A dataclass field that :func:`check_fields` keeps in [low, high] (None: unset, allowed
    when it is the default); ``name``: the field's name in errors."""
    return field(default=default, metadata={"range": (low, high), "name": name})


def choice(default: str, choices: tuple[str, ...], name: str) -> Any:
    """A dataclass field that :func:`check_fields` keeps among ``choices``."""
    return field(default=default, metadata={"choices": choices, "name": name})


def flag(default: bool, name: str) -> Any:
    """A dataclass field that :func:`check_fields` keeps a bool."""
    return field(default=default, metadata={"flag": True, "name": name})


def check_fields(config: Any) -> None:
    """A ConfigError for the first :func:`bounded`, :func:`choice` or :func:`flag` field of
    ``config`` whose value is not one it allows."""
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if "range" in meta and not (value is None and f.default is None):
            _check_range(meta["name"], value, *meta["range"])
        if "choices" in meta and value not in meta["choices"]:
            choices = ", ".join(meta["choices"])
            raise ConfigError(f"{meta['name']} must be one of {choices}; got {value!r}")
        if "flag" in meta and not isinstance(value, bool):
            raise ConfigError(f"{meta['name']} must be true or false, got {value!r}")


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or "auto"


def kv_bind_address(host: str) -> str:
    """The address the KV endpoint binds to and advertises: ``auto`` is this node's IP (pods of
    a Kubernetes RayCluster), anything else is taken as given."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()


def needs_encryption(mode: str, host: str) -> bool:
    """Whether the KV plane is encrypted: ``on``; ``off``; ``auto``: unless the decode
    workers' endpoints are on loopback (``host`` ``auto`` is the node's IP: encrypted)."""
    if mode != "auto":
        return mode == "on"
    return not is_loopback(host)


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``dtype`` (one of :data:`DTYPES`) as torch's; ``auto`` is fp32 on CPU (bf16 matmul is far
    slower there) and bf16 on CUDA."""
    import torch

    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``kv_cache_dtype`` (one of :data:`KV_CACHE_DTYPES`) as torch's; ``auto`` is the model's
    dtype: float32 on CPU. Both 16-bit dtypes pass the accuracy gate, halve the cache and decode
    long contexts faster, but a request computed anew from its tokens (a migration, a role
    switch, a prompt in other chunks) is then no longer token-identical at a near tie: float16
    on the bundled model's migration test, bfloat16 on the tiny random model's long outputs in
    the elastic and chaos tests (docs/configuration.md). So they are chosen, not the default."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    return getattr(torch, kv_cache_dtype)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = bounded(128, 1, 4096, "cacheBlockSize")
    # explicit block count; else derived from memory_mb
    num_blocks: int | None = bounded(None, 1, 1 << 24, "num_kv_blocks")
    memory_mb: int = bounded(1024, 1, 1 << 24, "kv_cache_memory_mb")  # kvCacheMemoryMB
    # enablePrefixCaching: full blocks stay cached after their request and are reused by any
    # later request with the same prefix (engine/block_manager.py)
    enable_prefix_caching: bool = flag(True, "enablePrefixCaching")
    # KV tiers under the prefix cache (engine/kv_tiers): evicted blocks kept in a node-shared
    # folder of shared memory and on disk, each capped (0: no such tier)
    host_tier_mb: int = bounded(0, 0, 1 << 24, "kv_host_tier_mb")
    host_tier_path: str = "/dev/shm/pdserve-kv"  # kv_host_tier_path
    disk_tier_mb: int = bounded(0, 0, 1 << 30, "kv_disk_tier_mb")
    disk_tier_path: str = ""  # kv_disk_tier_path
    # demotions of a block before it is written to disk (a block served from a tier: at once)
    disk_admit_after: int = bounded(2, 1, 64, "kv_disk_admit_after")
    # a request with a prompt_cache_key keeps its blocks this long after it ends: evicted after
    # every other cached block, in the cache and in every tier (0: no sessions)
    session_ttl_s: int = bounded(600, 0, 7 * 86400, "kv_session_ttl_s")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.disk_tier_mb and not self.disk_tier_path:
            raise ConfigError("kv_disk_tier_mb needs kv_disk_tier_path: the disk tier's folder")
        if (self.host_tier_mb or self.disk_tier_mb) and not self.enable_prefix_caching:
            raise ConfigError("KV tiers keep the prefix cache's blocks: enablePrefixCaching is off")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits."""

    max_seq_len: int = bounded(2560, 2, 1 << 22, "maxSeqLen")  # prompt + output tokens
    max_input_token_len: int = bounded(2048, 1, 1 << 22, "maxInputTokenLen")
    # output tokens per request
    max_iter_times: int = bounded(512, 1, 1 << 22, "maxIterTimes")
    max_batch_size: int = bounded(200, 1, 1 << 16, "maxBatchSize")  # running requests
    # prompt tokens per step (the chunk budget)
    max_prefill_tokens: int = bounded(8192, 1, 1 << 22, "maxPrefillTokens")
    max_prefill_batch_size: int = bounded(50, 1, 1 << 16, "maxPrefillBatchSize")  # prompts/step
    # a step that decodes running requests carries only the prompt tokens that fit in this time
    # (engine/step_budget.py); 0: up to max_prefill_tokens, always
    step_target_ms: int = bounded(0, 0, 60_000, "stepTargetMs")
    # a step with nothing to decode carries only the prompt tokens that fit in this time (at least
    # 512; engine/step_budget.py); 0: up to max_prefill_tokens
    prompt_step_target_ms: int = bounded(500, 0, 60_000, "prompt_step_target_ms")

    def __post_init__(self) -> None:
        check_fields(self)

    def max_prompt_tokens(self, max_position_embeddings: int) -> int:
        """The longest prompt: min(maxInputTokenLen, maxSeqLen - 1, the model's
        ``max_position_embeddings``)."""
        return min(self.max_input_token_len, self.max_seq_len - 1, max_position_embeddings)


@dataclass(frozen=True)
class KVTransferConfig:
    """How prefill and decode workers hand a request's KV over, and how long each side waits."""

    transport: str = choice("zmq", TRANSPORTS, "kv_transport")
    host: str = "127.0.0.1"  # kv_host: the decode workers' KV endpoint binds here ("auto": node IP)
    transfer_timeout_s: float = 10.0  # prefill frees its blocks if no acknowledgement by then
    reservation_timeout_s: float = 30.0  # decode ends a reservation whose pages never came
    # zmq on one host hands pages over in /dev/shm; False: always on the socket
    shared_memory: bool = flag(True, "kv_shared_memory")
    # CURVE / TLS with peer authentication (engine/transfer/security.py); "auto": on unless
    # ``host`` is a loopback address
    encryption: str = choice("auto", ENCRYPTION_MODES, "kv_encryption")
    # ``encryption`` "off" with ``host`` not a loopback address is refused unless this is set
    # (then every worker warns at start)
    allow_plaintext_off_loopback: bool = flag(False, "kv_allow_plaintext_off_loopback")
    # prefill workers pull a prompt's leading blocks from a peer that holds them when the
    # router's cost model says that is cheaper than computing them (engine/kv_pull.py)
    peer_pull: bool = flag(False, "kv_peer_pull")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.plaintext_off_loopback and not self.allow_plaintext_off_loopback:
            raise ConfigError(
                f"kv_encryption 'off' with kv_host {self.host!r}, not a loopback address: KV "
                "pages and reservation secrets would cross the network in plain text (an "
                "on-path host could read them and deliver forged pages). Use kv_encryption "
                "'auto' or 'on', bind kv_host to 127.0.0.1, or set "
                "kv_allow_plaintext_off_loopback: true on a network you trust"
            )
        for name in ("transfer_timeout_s", "reservation_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def encrypted(self) -> bool:
        """Whether hand-offs are encrypted and their peers authenticated (``inprocess``: never,
        nothing leaves the process)."""
        return self.transport != "inprocess" and needs_encryption(self.encryption, self.host)

    @property
    def plaintext_off_loopback(self) -> bool:
        """Whether hand-offs would cross a network unencrypted and unauthenticated."""
        return self.transport != "inprocess" and not self.encrypted and not is_loopback(self.host)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``engine/speculation.py``): drafts from n-gram lookup over each
    request's own tokens, verified several at a time, the output token-identical to decoding
    without them."""

    method: str = choice("off", SPECULATIVE_METHODS, "speculative_method")
    # tokens of a sequence's end that must match earlier in it, at least / compared, at most
    min_match: int = bounded(2, 1, 64, "speculative_min_match")
    max_match: int = bounded(4, 1, 64, "speculative_max_match")
    max_draft: int = bounded(4, 1, 16, "speculative_max_draft")  # tokens drafted per request
    # a step's rows (decode rows plus drafted tokens) speculation grows it to, at most: under
    # load, the step's rows are the batch's own and nothing is drafted
    max_step_rows: int = bounded(8, 1, 1024, "speculative_max_step_rows")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_match > self.max_match:
            raise ConfigError(
                f"speculative_min_match must be in [1, speculative_max_match={self.max_match}], "
                f"got {self.min_match}"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs."""

    model_path: str = "bundled"  # model_path: "bundled", a HF directory, or a .gguf file
    device: str = "auto"
    dtype: str = choice("auto", DTYPES, "dtype")
    # auto (a GGUF's own blocks on CPU fp32), fp32, int8, int4 (model/linear.py)
    weight_dtype: str = choice("auto", WEIGHT_DTYPES, "weight_dtype")
    # auto (float32 for now), float32 (exact up to summation order) or bfloat16 (model/linear.py)
    prompt_matmul_dtype: str = choice("auto", PROMPT_MATMUL_DTYPES, "prompt_matmul_dtype")
    # auto (float32 for now), int8 (8-bit groups, integer dot products) or float32
    activation_dtype: str = choice("auto", ACTIVATION_DTYPES, "activation_dtype")
    # what the paged KV cache stores: auto (the model's dtype), float32, bfloat16 or float16
    kv_cache_dtype: str = choice("auto", KV_CACHE_DTYPES, "kv_cache_dtype")
    # torch intra-op threads for this engine's process
    num_threads: int | None = bounded(None, 1, 1024, "num_threads")
    # every decode row's logits independent of the rows beside it in its step (engine/
    # speculation.py): on whenever speculative decoding is; on alone, the same tokens as with it
    batch_invariant: bool = flag(False, "batch_invariant")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return resolve_kv_dtype(self.kv_cache_dtype, self.torch_dtype)
