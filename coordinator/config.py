"""``ms_coordinator.json``: MindIE-MS compatible sections plus pdserve's ``backend_config``.

Every key is declared once below with its type and valid range; a wrong type or an out-of-range
value is a :class:`ConfigError` naming ``section.key``, the valid range and the value received.
Unknown keys are ignored with a warning. Precedence: CLI > file > defaults.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_PATH_ENV = "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"


@dataclass(frozen=True)
class Key:
    """One configuration key: its kind (``int``, ``port``, ``float``, ``bool``, ``str``, ``ip``,
    ``list``), default, and range or choices."""

    kind: str
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.low is not None and self.high is not None:
            if self.kind in ("int", "port"):
                return f"an integer in [{int(self.low)}, {int(self.high)}]"
            return f"a number in [{self.low:g}, {self.high:g}]"
        return {
            "bool": "true or false",
            "ip": "an IP address",
            "list": "a list of strings",
            "str": "a string",
            "dict": "a JSON object",
        }[self.kind]

    def parse(self, name: str, value: Any) -> Any:
        try:
            parsed = self._convert(value)
        except (TypeError, ValueError):
            parsed = None
        if (
            parsed is None
            or (self.choices and parsed not in self.choices)
            or (self.low is not None and not self.low <= parsed <= self.high)
        ):
            raise ConfigError(f"{name} must be {self.describe()}, got {json.dumps(value)}")
        return parsed

    def _convert(self, value: Any) -> Any:
        if self.kind == "bool":
            return value if isinstance(value, bool) else None
        if self.kind in ("int", "port"):
            if isinstance(value, bool | float):
                return None
            if self.kind == "port" and isinstance(value, str) and value.isdigit():
                return int(value)
            return value if isinstance(value, int) else None
        if self.kind == "float":
            return (
                float(value)
                if isinstance(value, int | float) and not isinstance(value, bool)
                else None
            )
        if self.kind == "ip":
            return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
        if self.kind == "dict":
            return value if isinstance(value, dict) else None
        if self.kind == "list":
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            return tuple(value) if ok else None
        return value if isinstance(value, str) else None


PORT = (1024, 65535)
# stepTargetMs when the file leaves it out: in pd_separate it sizes the chunks of the prompts a
# decode worker computes itself, so its streams stay smooth; single_node fills each step up to
# maxPrefillTokens, which gives long prompts their first token soonest (docs/configuration.md)
STEP_TARGET_MS = {"pd_separate": 100, "single_node": 0}
SCHEMA: dict[str, dict[str, Key]] = {
    "http_config": {
        "predict_ip": Key("ip", "127.0.0.1"),
        "predict_port": Key("port", 1025, *PORT),
        "manage_ip": Key("ip", "127.0.0.1"),
        "manage_port": Key("port", 1026, *PORT),
        "status_port": Key("port", 1029, *PORT),
        "external_port": Key("port", 1028, *PORT),
        "allow_all_zero_ip_listening": Key("bool", False),
        "api_keys": Key("list", ()),
        "manage_api_keys": Key("list", ()),
    },
    "request_limit": {
        "max_requests": Key("int", 10000, 1, 1_000_000),
        "body_limit": Key("int", 32, 1, 1024),
    },
    "exception_config": {
        "schedule_timeout": Key("int", 600, 0, 86400),
        "first_token_timeout": Key("int", 600, 0, 86400),
        "infer_timeout": Key("int", 600, 0, 86400),
        "max_retry": Key("int", 5, 0, 100),
    },
    "digs_scheduler_config": {
        "deploy_mode": Key("str", "pd_separate", choices=("pd_separate", "single_node")),
        "algorithm_type": Key("str", "load_balance", choices=("load_balance",)),
        # cache-aware routing (coordinator/router.py): prefer workers holding a request's prefix
        "prefix_routing": Key("bool", True),
        "prefix_routing_max_imbalance": Key("int", 8192, 0, 1 << 22),  # queued prompt tokens
        "prefix_routing_max_decode_imbalance": Key("int", 4, 0, 1 << 16),  # running requests
        "prefix_routing_ttl_s": Key("int", 600, 1, 86400),
    },
    "tls_config": {
        "request_server_tls_enable": Key("bool", False),
        "tls_cert": Key("str", ""),
        "tls_key": Key("str", ""),
        "ca_cert": Key("str", ""),
    },
    "log_info": {
        "log_level": Key("str", "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")),
    },
    "content_safety": {
        "enabled": Key("bool", False),
        "categories": Key("dict", {}),
    },
    "backend_config": {
        "model_path": Key("str", "bundled"),
        "embedding_model_path": Key("str", "bundled"),
        "model_config": Key("dict", {}),  # MLflow models: load-time model_config overrides
        "dtype": Key("str", "auto", choices=("auto", "float32", "bfloat16", "float16")),
        # the linear layers' weights: auto (a GGUF's own blocks on CPU fp32), fp32, int8, int4
        "weight_dtype": Key("str", "auto", choices=("auto", "fp32", "int8", "int4")),
        "device": Key("str", "auto"),
        "num_prefill_instances": Key("int", 1, 1, 1024),
        "num_decode_instances": Key("int", 1, 1, 1024),
        "num_colocated_instances": Key("int", 1, 1, 1024),  # single_node engines
        "kv_transport": Key("str", "zmq", choices=("zmq", "grpc")),
        "ray_address": Key("str", ""),
        "kv_host": Key("str", "127.0.0.1"),  # decode KV endpoints bind here; "auto": node IP
        "kv_shared_memory": Key("bool", True),  # zmq on one host: pages through /dev/shm
        # pd_separate: a worker runs extra threads on an idle co-located worker's cores
        "share_idle_cores": Key("bool", True),
        # with it: a busy decode worker pauses up to this long for a co-located long prefill
        "decode_yield_ms": Key("int", 0, 0, 10_000),
        # and paused at most this share of its time in the long run
        "decode_yield_percent": Key("int", 20, 1, 100),
        # and each pause only as long as every stream affords within this TPOT (0: no target)
        "decode_yield_tpot_ms": Key("int", 0, 0, 60_000),
        # CURVE / TLS with peer authentication on the KV plane; auto: unless kv_host is loopback
        "kv_encryption": Key("str", "auto", choices=("auto", "on", "off")),
        "kv_transfer_timeout_s": Key("int", 10, 1, 3600),
        "kv_reservation_timeout_s": Key("int", 30, 1, 3600),
        "prefill_resources": Key("dict", {}),  # {"num_cpus", "num_gpus", "resources": {...}}
        "decode_resources": Key("dict", {}),
        "colocated_resources": Key("dict", {}),
        "maxSeqLen": Key("int", 2560, 2, 1 << 22),
        "maxInputTokenLen": Key("int", 2048, 1, 1 << 22),
        "maxIterTimes": Key("int", 512, 1, 1 << 22),
        "maxBatchSize": Key("int", 200, 1, 1 << 16),
        "maxPrefillTokens": Key("int", 8192, 1, 1 << 22),
        "maxPrefillBatchSize": Key("int", 50, 1, 1 << 16),
        # prompt tokens per decoding step: what fits (default: STEP_TARGET_MS by deploy mode)
        "stepTargetMs": Key("int", None, 0, 60_000),
        "cacheBlockSize": Key("int", 128, 1, 4096),
        "kvCacheMemoryMB": Key("int", 1024, 1, 1 << 24),
        "enablePrefixCaching": Key("bool", True),
        # pd_separate: decode workers prefill short prompts themselves (coordinator/router.py)
        "local_prefill_tokens": Key("int", 96, 0, 1 << 22),
        "local_prefill_queue_tokens": Key("int", 1024, 0, 1 << 22),
        "local_prefill_fallback": Key("bool", True),
        "fullTextEnabled": Key("bool", False),
        "truncation": Key("bool", False),
        "allowed_media_dirs": Key("list", ()),
    },
}


@dataclass(frozen=True)
class CoordinatorConfig:
    """The parsed file: ``values[section][key]``, every key present (defaults filled in)."""

    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str | None = None

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.values[section]

    @property
    def step_target_ms(self) -> int:
        """``stepTargetMs`` as set, else the deploy mode's default (``STEP_TARGET_MS``)."""
        value = self.values["backend_config"]["stepTargetMs"]
        mode = self.values["digs_scheduler_config"]["deploy_mode"]
        return STEP_TARGET_MS[mode] if value is None else value

    def with_overrides(self, overrides: dict[str, Any]) -> CoordinatorConfig:
        """``{"section.key": value}`` from the CLI (None values are skipped), validated too."""
        values = {section: dict(keys) for section, keys in self.values.items()}
        for dotted, value in overrides.items():
            if value is None:
                continue
            section, key = dotted.split(".")
            values[section][key] = SCHEMA[section][key].parse(dotted, value)
        return _checked(CoordinatorConfig(values, self.source))


def defaults() -> CoordinatorConfig:
    return CoordinatorConfig(
        {s: {k: spec.default for k, spec in keys.items()} for s, keys in SCHEMA.items()}
    )


def load_config(path: str | os.PathLike | None = None) -> CoordinatorConfig:
    """Read ``path`` (or ``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``); defaults when neither."""
    path = path or os.environ.get(CONFIG_PATH_ENV)
    base = defaults()
    if not path:
        return base
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    values = {section: dict(keys) for section, keys in base.values.items()}
    for section, keys in raw.items():
        if section not in SCHEMA:
            log.warning("config: unknown section %r ignored", section)
            continue
        if not isinstance(keys, dict):
            raise ConfigError(f"{section} must be a JSON object, got {json.dumps(keys)}")
        for key, value in keys.items():
            if key not in SCHEMA[section]:
                log.warning("config: unknown key %s.%s ignored", section, key)
                continue
            values[section][key] = SCHEMA[section][key].parse(f"{section}.{key}", value)
    return _checked(CoordinatorConfig(values, str(path)))


def _checked(config: CoordinatorConfig) -> CoordinatorConfig:
    from coordinator.cluster_config import ActorResources
    from coordinator.content_safety import ContentFilter

    default = ActorResources()

    ContentFilter.from_config(config["content_safety"])  # a bad pattern fails at start-up
    for role in ("prefill", "decode", "colocated"):
        key = f"{role}_resources"
        ActorResources.from_dict(f"backend_config.{key}", config["backend_config"][key], default)
    http = config["http_config"]
    if not http["allow_all_zero_ip_listening"]:
        for key in ("predict_ip", "manage_ip"):
            if http[key] in ("0.0.0.0", "::"):
                raise ConfigError(
                    f"http_config.{key} {http[key]} listens on every address; set "
                    "http_config.allow_all_zero_ip_listening to true to allow it"
                )
    tls = config["tls_config"]
    if tls["request_server_tls_enable"] and not (tls["tls_cert"] and tls["tls_key"]):
        raise ConfigError(
            "tls_config.request_server_tls_enable needs tls_config.tls_cert and tls_config.tls_key"
        )
    return config


def check_manage_listener(config: CoordinatorConfig) -> None:
    """The management API must stay on loopback unless it has keys of its own: a manage listener
    on any other address with no ``http_config.manage_api_keys`` is a :class:`ConfigError`."""
    http = config["http_config"]
    if not ipaddress.ip_address(http["manage_ip"]).is_loopback and not http["manage_api_keys"]:
        raise ConfigError(
            f"http_config.manage_ip {http['manage_ip']} is not a loopback address; set "
            "http_config.manage_api_keys to protect the management API there (or bind it to "
            "127.0.0.1)"
        )
