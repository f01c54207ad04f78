"""The Helm chart's ``msCoordinator`` values and their JSON schema, generated from the key schema
with docs/configuration.md's tables (``python -m coordinator.config.docs``).

The chart manages ``tls_config`` (from its ``tls`` values) and the API keys (from Secrets), so
neither is in ``msCoordinator``; a few keys it sets itself unless the values do (``CHART_SETS``:
``templates/_helpers.tpl``) are shown commented out, and a few take another default in a pod
(``CHART_DEFAULTS``). The values sit between ``# <generated>`` and ``# </generated>`` in
values.yaml; everything outside them is the chart's own.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

from coordinator.config.cluster import CLUSTER_NAME
from coordinator.config.keys import Key
from coordinator.config.schema import SCHEMA

MANAGED = ("tls_config", "http_config.api_keys", "http_config.manage_api_keys")
# keys listed with another default in the chart
CHART_DEFAULTS: dict[str, Any] = {
    "http_config.predict_ip": "0.0.0.0",
    "http_config.allow_all_zero_ip_listening": True,
}
# what a key means in the chart, after its doc
CHART_NOTES = {
    "http_config.predict_ip": "in the chart: every pod address",
    "http_config.predict_port": "HTTPS when tls.enabled",
    "http_config.manage_ip": "in the chart: reached with `kubectl port-forward`; "
    "coordinator.service.exposeManagePort needs 0.0.0.0 here and apiKeys.manage",
    "http_config.allow_all_zero_ip_listening": "in the chart: a pod needs it",
    "backend_config.model_path": "in the chart: a path under model.mountPath",
    "backend_config.num_prefill_instances": "one per prefill pod: keep it prefill.replicas",
    "backend_config.num_decode_instances": "one per decode pod: keep it decode.replicas",
    "backend_config.ray_address": 'in the chart, `""` is the RayCluster\'s head',
    "backend_config.cluster_name": 'in the chart, `""` is the release\'s full name',
}
# keys the chart sets itself unless the values do, shown commented out with what it sets
CHART_SETS: dict[str, tuple[Any, str]] = {
    "backend_config.kv_host": ("auto", "the pod IP"),
    "backend_config.kv_encryption": ("on", "between pods"),
    **{
        f"backend_config.{role}_resources": (
            {"num_cpus": 1, "num_gpus": 0, "resources": {f"pdserve_{role}": 1}},
            f"the {role} group's CPUs and GPUs, and its pdserve_{role} resource",
        )
        for role in ("prefill", "decode")
    },
}
RESOURCES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "num_cpus": {"type": "number", "minimum": 0},
        "num_gpus": {"type": "number", "minimum": 0},
        "resources": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
    },
}
STRINGS = {"type": "array", "items": {"type": "string"}}
CATEGORY = {"terms": STRINGS, "patterns": STRINGS}
SHAPES: dict[str, dict[str, Any]] = {
    "content_safety.categories": {
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "additionalProperties": False,
            "properties": CATEGORY,
        },
    },
    **{
        f"backend_config.{role}_resources": RESOURCES for role in ("prefill", "decode", "colocated")
    },
    "backend_config.cluster_name": {"type": "string", "pattern": f"^({CLUSTER_NAME.pattern})?$"},
}
KINDS: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"},
    "port": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "ip": {"type": "string", "minLength": 2},  # "::" is the shortest
    "list": STRINGS,
    "dict": {"type": "object"},
}
LINK = re.compile(r"\[([^]]+)\]\([^)]+\)")
VALUES_BLOCK = re.compile(r"(  # <generated>\n)(.*?)(  # </generated>)", re.DOTALL)


def chart_keys() -> dict[str, list[Key]]:
    """The keys of each section ``msCoordinator`` holds."""
    sections = {name: list(keys.values()) for name, keys in SCHEMA.items() if name not in MANAGED}
    return {name: [k for k in keys if k.dotted not in MANAGED] for name, keys in sections.items()}


def plain(doc: str) -> str:
    """A key's doc without its Markdown links and its pointers into docs/configuration.md."""
    return LINK.sub(r"\1", doc).replace(" (below)", "")


def key_schema(key: Key) -> dict[str, Any]:
    """The JSON schema of one key's value."""
    schema = dict(SHAPES.get(key.dotted) or KINDS.get(key.kind, {"type": "string"}))
    if key.choices:
        schema["enum"] = list(key.choices)
    if key.low is not None:
        schema |= {"minimum": key.low, "maximum": key.high}
    return schema | {"description": plain(key.doc)}


def values_schema() -> dict[str, Any]:
    """``properties.msCoordinator`` of values.schema.json."""
    sections = {
        name: {
            "type": "object",
            "additionalProperties": False,
            "properties": {key.name: key_schema(key) for key in keys},
        }
        for name, keys in chart_keys().items()
    }
    return {"type": "object", "additionalProperties": False, "properties": sections}


def _comment(text: str, indent: str) -> list[str]:
    lines = textwrap.wrap(text, 100 - len(indent) - 5, break_on_hyphens=False)
    return [f"{indent}# -- {lines[0]}", *(f"{indent}#    {line}" for line in lines[1:])]


def key_lines(key: Key) -> list[str]:
    """One key of values.yaml: its doc as a comment, then the key and its chart default
    (commented out where the chart, or another key, decides it)."""
    value, note = CHART_DEFAULTS.get(key.dotted, key.default), CHART_NOTES.get(key.dotted, "")
    if key.dotted in CHART_SETS:
        value, set_to = CHART_SETS[key.dotted]
        note = f"unset: the chart sets {json.dumps(value)}, {set_to}"
    elif key.default_by:
        other, defaults = key.default_by
        value = next(iter(defaults.values()))
        note = "unset: " + ", ".join(f"{v} with {other} {c}" for c, v in defaults.items())
    text = json.dumps(list(value) if isinstance(value, tuple) else value)
    line = f"{key.name}: {text}"
    commented = key.dotted in CHART_SETS or key.default_by
    comment = _comment(plain(key.doc) + (f" ({note})" if note else ""), "    ")
    return [*comment, f"    # {line}" if commented else f"    {line}"]


def values_yaml() -> str:
    """The generated part of values.yaml's ``msCoordinator``."""
    lines = []
    for name, keys in chart_keys().items():
        lines += [f"  # -- ms_coordinator.json's {name} (docs/configuration.md).", f"  {name}:"]
        lines += [line for key in keys for line in key_lines(key)]
    return "\n".join(lines) + "\n"


def render_values(text: str) -> str:
    """values.yaml ``text`` with its generated block rewritten."""
    if not VALUES_BLOCK.search(text):
        raise ValueError("values.yaml: no '  # <generated>' ... '  # </generated>' block")
    return VALUES_BLOCK.sub(lambda m: m[1] + values_yaml() + m[3], text)


def render_schema(text: str) -> str:
    """values.schema.json ``text`` with its ``msCoordinator`` generated."""
    schema = json.loads(text)
    schema["properties"]["msCoordinator"] = values_schema()
    return json.dumps(schema, indent=2) + "\n"
