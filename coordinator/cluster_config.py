"""How the worker cluster is laid out: deploy mode, actor counts and resources, KV transport."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.config import EngineConfig, KVTransferConfig
from engine.errors import ConfigError

DEPLOY_MODES = ("pd_separate", "single_node")


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources, e.g. a node group's

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ConfigError(f"actor resources must be >= 0, got {self}")
        if any(amount < 0 for _, amount in self.resources):
            raise ConfigError(f"custom resources must be >= 0, got {dict(self.resources)}")

    @classmethod
    def from_dict(cls, name: str, value: dict, default: ActorResources) -> ActorResources:
        """``{"num_cpus", "num_gpus", "resources": {name: amount}}``, each key optional."""
        custom = value.get("resources", dict(default.resources))
        amounts = [value.get("num_cpus", 0), value.get("num_gpus", 0)]
        amounts += list(custom.values()) if isinstance(custom, dict) else [None]
        if set(value) - {"num_cpus", "num_gpus", "resources"} or not all(
            isinstance(n, int | float) and not isinstance(n, bool) and n >= 0 for n in amounts
        ):
            raise ConfigError(
                f'{name} must be {{"num_cpus": >= 0, "num_gpus": >= 0, "resources": '
                f"{{name: >= 0}}}}, got {json.dumps(value)}"
            )
        return cls(
            float(value.get("num_cpus", default.num_cpus)),
            float(value.get("num_gpus", default.num_gpus)),
            tuple(sorted((str(k), float(v)) for k, v in custom.items())),
        )

    @property
    def num_threads(self) -> int:
        """torch threads for the actor: one per CPU it owns."""
        return max(1, int(self.num_cpus))


@dataclass(frozen=True)
class ClusterConfig:
    deploy_mode: str = "pd_separate"
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 1  # single_node: engines that each do prefill and decode
    kv_transport: str = "zmq"
    kv_host: str = "127.0.0.1"  # address decode workers bind their KV endpoint to ("auto": node IP)
    kv_shared_memory: bool = True  # zmq on one host: pages through /dev/shm (False: the socket)
    kv_encryption: str = "auto"  # CURVE / TLS on the KV plane; auto: unless kv_host is loopback
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill_resources: ActorResources = field(default_factory=ActorResources)
    decode_resources: ActorResources = field(default_factory=ActorResources)
    colocated_resources: ActorResources = field(default_factory=lambda: ActorResources(2.0))
    transfer_timeout_s: float = 10.0  # prefill frees its blocks if no acknowledgement by then
    reservation_wait_s: float = 5.0  # how long a hand-off waits for room on a full decode worker
    reservation_timeout_s: float = 30.0  # decode drops a reservation whose pages never came
    pin_cpus: bool = True  # local Ray: give each actor its own cores when they add up
    share_idle_cores: bool = False  # pd_separate: workers run threads on idle co-located peers'
    decode_yield_ms: int = 0  # with it: a decode worker's longest pause for a long prefill
    decode_yield_percent: int = 20  # the most of its time a decode worker spends paused
    decode_yield_tpot_ms: int = 0  # each pause only as long as every stream's TPOT affords
    generation: bool = True  # False: an embeddings-only cluster (no prefill/decode actors)
    embedding_model_path: str | None = "bundled"  # None: no embedding worker
    embedding_resources: ActorResources = field(default_factory=lambda: ActorResources(0.0))

    def __post_init__(self) -> None:
        if self.deploy_mode not in DEPLOY_MODES:
            raise ConfigError(
                f"deploy_mode must be one of {', '.join(DEPLOY_MODES)}; got {self.deploy_mode!r}"
            )
        self.kv_transfer  # noqa: B018 - validates the hand-off fields
        for name in ("num_prefill", "num_decode", "num_colocated"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1024:
                raise ConfigError(f"{name} must be an integer in [1, 1024], got {value!r}")
        if self.reservation_wait_s <= 0:
            raise ConfigError(f"reservation_wait_s must be > 0, got {self.reservation_wait_s!r}")

    @property
    def kv_transfer(self) -> KVTransferConfig:
        """The hand-off settings both worker roles take."""
        return KVTransferConfig(
            self.kv_transport,
            self.kv_host,
            self.transfer_timeout_s,
            self.reservation_timeout_s,
            self.kv_shared_memory,
            self.kv_encryption,
        )
