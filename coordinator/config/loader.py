"""``ms_coordinator.json``: MindIE-MS compatible sections plus pdserve's ``backend_config``.

Every key is declared once, in ``coordinator/config/schema.py``, with its type and valid range; a
wrong type or an out-of-range value is a :class:`ConfigError` naming ``section.key``, the valid
range and the value received (of a secret such as ``api_keys``, or of a section that is not an
object, only the value's type and length). Unknown keys are ignored with a warning.

Precedence, lowest first: the defaults, the file, the environment, the command line. The
environment variable of a key is ``PDSERVE_<SECTION>__<KEY>``, both names upper case (e.g.
``PDSERVE_BACKEND_CONFIG__MAXSEQLEN=4096``, ``PDSERVE_HTTP_CONFIG__PREDICT_PORT=8080``); its
text is read by the key's type: integers in decimal, ``true`` / ``false`` (or ``1`` / ``0``),
objects as JSON, lists as JSON or comma-separated. Other ``PDSERVE_`` variables with a ``__``
are ignored with a warning.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config.cluster import ClusterConfig
from coordinator.config.keys import Key, build, value_shape
from coordinator.config.schema import KEYS, SCHEMA
from coordinator.content_safety import ContentFilter
from engine.errors import ConfigError

__all__ = [
    "CONFIG_PATH_ENV",
    "SCHEMA",
    "CoordinatorConfig",
    "check_manage_listener",
    "defaults",
    "load_config",
]
log = logging.getLogger(__name__)

CONFIG_PATH_ENV = "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH"
ENV_PREFIX, ENV_SEPARATOR = "PDSERVE_", "__"
ENV_KEYS = {key.env_name: key for key in KEYS}
Values = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class CoordinatorConfig:
    """The parsed configuration: ``values[section][key]``, every key present (defaults filled
    in; None where a key's default depends on another key)."""

    values: Values = field(default_factory=dict)
    source: str | None = None

    def __getitem__(self, section: str) -> dict[str, Any]:
        return self.values[section]

    def value(self, key: Key) -> Any:
        """``key``'s value; left out, and with a ``default_by``, the other key's choice."""
        value = self.values[key.section][key.name]
        if value is None and key.default_by:
            other, defaults = key.default_by
            section, name = other.split(".")
            return defaults[self.values[section][name]]
        return value

    def fed(self, target: type) -> dict[str, Any]:
        """``{field path: value}`` of every key that feeds a field of dataclass ``target``."""
        return {
            key.feeds.path: key.feeds.value(key.dotted, self.value(key))
            for key in KEYS
            if key.feeds and key.feeds.target is target
        }

    def with_overrides(self, overrides: Mapping[str, Any]) -> CoordinatorConfig:
        """``{"section.key": value}`` from the CLI (None values are skipped), validated too."""
        values = _copy(self.values)
        for dotted, value in overrides.items():
            if value is not None:
                section, key = dotted.split(".")
                values[section][key] = SCHEMA[section][key].parse(dotted, value)
        return _checked(CoordinatorConfig(values, self.source))


def defaults() -> CoordinatorConfig:
    return CoordinatorConfig(
        {s: {name: key.default for name, key in keys.items()} for s, keys in SCHEMA.items()}
    )


def load_config(
    path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None
) -> CoordinatorConfig:
    """The defaults, then ``path`` (or ``$MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH``; neither:
    no file), then the ``PDSERVE_<SECTION>__<KEY>`` variables of ``environ`` (``os.environ``)."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(CONFIG_PATH_ENV)
    values = _copy(defaults().values)
    if path:
        _merge_file(values, _read(path))
    _merge_environment(values, environ)
    return _checked(CoordinatorConfig(values, str(path) if path else None))


def _copy(values: Values) -> Values:
    return {section: dict(keys) for section, keys in values.items()}


def _read(path: str | os.PathLike) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    return raw


def _merge_file(values: Values, raw: dict[str, Any]) -> None:
    for section, keys in raw.items():
        if section not in SCHEMA:
            log.warning("config: unknown section %r ignored", section)
            continue
        if not isinstance(keys, dict):
            raise ConfigError(f"{section} must be a JSON object, got {value_shape(keys)}")
        for name, value in keys.items():
            if name not in SCHEMA[section]:
                log.warning("config: unknown key %s.%s ignored", section, name)
                continue
            values[section][name] = SCHEMA[section][name].parse(f"{section}.{name}", value)


def _merge_environment(values: Values, environ: Mapping[str, str]) -> None:
    for variable, text in sorted(environ.items()):
        if not variable.upper().startswith(ENV_PREFIX) or ENV_SEPARATOR not in variable:
            continue
        key = ENV_KEYS.get(variable.upper())
        if key is None:
            log.warning("config: unknown environment variable %s ignored", variable)
            continue
        values[key.section][key.name] = key.parse_text(key.dotted, text)


def _checked(config: CoordinatorConfig) -> CoordinatorConfig:
    ContentFilter.from_config(config["content_safety"])  # a bad pattern fails at start-up
    for spec in KEYS:  # and so does a value its field would refuse
        if spec.feeds and spec.feeds.convert:
            spec.feeds.value(spec.dotted, config.value(spec))
    http = config["http_config"]
    if not http["allow_all_zero_ip_listening"]:
        for key in ("predict_ip", "manage_ip"):
            if http[key] in ("0.0.0.0", "::"):
                raise ConfigError(
                    f"http_config.{key} {http[key]} listens on every address; set "
                    "http_config.allow_all_zero_ip_listening to true to allow it"
                )
    for key in ("api_keys", "manage_api_keys"):
        _check_keys(f"http_config.{key}", http[key])
    _check_priorities(http["api_key_priority"], http["api_keys"])
    build(ClusterConfig, config.fed(ClusterConfig))  # and the cluster's own checks (KV plane)
    tls = config["tls_config"]
    if tls["request_server_tls_enable"] and not (tls["tls_cert"] and tls["tls_key"]):
        raise ConfigError(
            "tls_config.request_server_tls_enable needs tls_config.tls_cert and tls_config.tls_key"
        )
    return config


def _check_priorities(priorities: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Each entry of ``http_config.api_key_priority`` names one of ``api_keys`` (a key is never
    echoed: it is a secret) and an integer priority in [1, 5]."""
    for index, (key, priority) in enumerate(priorities.items()):
        name = f"http_config.api_key_priority (entry {index + 1})"
        if key not in keys:
            raise ConfigError(f"{name} names a key that is not in http_config.api_keys")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 5:
            raise ConfigError(f"{name} must be an integer in [1, 5], got {json.dumps(priority)}")


def _check_keys(name: str, keys: tuple[str, ...]) -> None:
    """An empty (or blank) API key is refused: it would let in a request whose key header is
    empty, and the gate never matches one."""
    for index, key in enumerate(keys):
        if not key.strip():
            raise ConfigError(
                f"{name}[{index}] is empty: an API key must hold a non-blank string (remove it)"
            )


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
