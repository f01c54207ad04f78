"""How the worker cluster is laid out: deploy mode, actor counts and resources, KV transport."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from engine.config import EngineConfig, KVTransferConfig, bounded, check_fields, choice
from engine.errors import ConfigError

DEPLOY_MODES = ("pd_separate", "single_node")
CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}")


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

    def describe(self) -> str:
        """In words, e.g. ``1 CPU, no GPU``."""
        amounts = [("CPU", self.num_cpus), ("GPU", self.num_gpus), *self.resources]
        return ", ".join(_amount(name, value) for name, value in amounts)

    @property
    def num_threads(self) -> int:
        """torch threads for the actor: one per CPU it owns."""
        return max(1, int(self.num_cpus))


def _amount(name: str, value: float) -> str:
    if value == 0:
        return f"no {name}"
    return f"{value:g} {name}{'' if value == 1 or name not in ('CPU', 'GPU') else 's'}"


@dataclass(frozen=True)
class ClusterConfig:
    """The worker cluster: its engines, actors and the KV hand-off between them."""

    deploy_mode: str = choice("pd_separate", DEPLOY_MODES, "deploy_mode")
    num_prefill: int = bounded(1, 1, 1024, "num_prefill")
    num_decode: int = bounded(1, 1, 1024, "num_decode")
    # pd_separate: workers that switch roles while they serve (elastic_worker/worker.py), started
    # num_prefill as prefill and num_decode as decode
    elastic_roles: bool = False
    # elastic_roles: the most workers the planner may grow the pool to (0: the pool's size is
    # fixed at num_prefill + num_decode)
    max_workers: int = bounded(0, 0, 1024, "max_workers")
    # single_node: engines that each do prefill and decode
    num_colocated: int = bounded(1, 1, 1024, "num_colocated")
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)  # the hand-off, both roles
    engine: EngineConfig = field(default_factory=EngineConfig)
    # KV cache of each prefill engine; 0: the engine's own (kvCacheMemoryMB)
    prefill_kv_memory_mb: int = bounded(0, 0, 1 << 24, "prefill_kv_cache_memory_mb")
    prefill_resources: ActorResources = field(default_factory=ActorResources)
    decode_resources: ActorResources = field(default_factory=ActorResources)
    colocated_resources: ActorResources = field(default_factory=lambda: ActorResources(2.0))
    reservation_wait_s: float = 5.0  # how long a hand-off waits for room on a full decode worker
    pin_cpus: bool = True  # local Ray: give each actor its own cores when they add up
    # how many busy-wait turns an engine's idle OpenMP threads take before they sleep (GNU
    # OpenMP's GOMP_SPINCOUNT, set in each worker's environment; 300000 is the runtime's own)
    omp_spin_count: int = bounded(300_000, 0, 1 << 30, "omp_spin_count")
    generation: bool = True  # False: an embeddings-only cluster (no prefill/decode actors)
    embedding_model_path: str | None = "bundled"  # None: no embedding worker
    embedding_resources: ActorResources = field(default_factory=lambda: ActorResources(0.0))
    # "": the workers are this coordinator's own (started with it, stopped with it); a name: a
    # pool of named, detached actors in the Ray namespace "pdserve-<name>", which every
    # coordinator of that name finds (the first one starts it) and leaves running at exit
    cluster_name: str = ""
    # with cluster_name: the coordinator that stops last (no other one's lease is live on the
    # workers) stops the pool too
    own_workers: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if self.cluster_name and not CLUSTER_NAME.fullmatch(self.cluster_name):
            raise ConfigError(
                "cluster_name must be 1-40 letters, digits, '-' or '_' (starting with a letter "
                f"or digit), got {self.cluster_name!r}"
            )
        if self.max_workers:
            self._check_scaling()
        if self.reservation_wait_s <= 0:
            raise ConfigError(f"reservation_wait_s must be > 0, got {self.reservation_wait_s!r}")

    def _check_scaling(self) -> None:
        start = self.num_prefill + self.num_decode
        if not self.elastic_roles or self.deploy_mode != "pd_separate":
            raise ConfigError("max_workers needs elastic_roles: true (pd_separate)")
        if self.max_workers < start:
            raise ConfigError(
                f"max_workers must be 0 or at least num_prefill_instances + "
                f"num_decode_instances ({start}), got {self.max_workers}"
            )
        if self.cluster_name:
            raise ConfigError("max_workers needs a private pool: a shared pool's (cluster_name) "
                              "size is fixed")  # fmt: skip

    @property
    def namespace(self) -> str | None:
        """The Ray namespace of a shared pool's actors (None: the workers are private)."""
        return f"pdserve-{self.cluster_name}" if self.cluster_name else None
