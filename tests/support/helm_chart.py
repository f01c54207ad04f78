"""Rendering the Helm chart and reading its objects: what the chart, image and replica tests
share."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


CHART = ROOT / "deploy" / "helm" / "pdserve"


CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


CRDS = ROOT.parent / "shared" / "kuberay-crds"


RELEASE, NAMESPACE = "demo", "serving"


SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"


CERT_MANAGER_API = "cert-manager.io/v1"


CUSTOM_KINDS = {
    ("ray.io/v1", "RayCluster"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


BUILTIN_KINDS = {
    "ConfigMap",
    "Secret",
    "Service",
    "Deployment",
    "NetworkPolicy",
    "PodDisruptionBudget",
}


KUBE_VERSIONS = ("1.25", kubernetes_validate.latest_version())  # Chart.yaml kubeVersion: >=1.25


NAMES = [path.name.removesuffix("-values.yaml") for path in CI_VALUES]


CASES = [(name, monitoring) for name in NAMES for monitoring in (False, True)]


CASE_IDS = [f"{name}{'+prometheus-operator' if monitoring else ''}" for name, monitoring in CASES]


# The image's user and home (deploy/docker/Dockerfile); tests/deploy/test_dockerfile.py holds the
# Dockerfile to them.
IMAGE_UID, IMAGE_GID, IMAGE_HOME = 1000, 100, "/home/ray"


# Paths Ray and pdserve write to at run time: each must lie on a writable (emptyDir) volume.
WRITABLE_PATHS = (
    "/tmp",
    "/tmp/ray",
    "/dev/shm",
    f"{IMAGE_HOME}/.cache/pdserve",
    f"{IMAGE_HOME}/.cache/torch_extensions",
)


def helm_binary() -> Path:
    cached = ROOT / ".cache" / "tools" / "bin" / "helm"
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    found = shutil.which("helm")
    if found:
        return Path(found)
    pytest.fail(
        f"no helm binary at {cached} nor on PATH: run `python scripts/fetch_helm.py` "
        "(scripts/install.sh does it)"
    )


def run_helm(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [helm_binary(), *args], capture_output=True, text=True, timeout=60, check=False
    )


def values_file(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


def values_of(name: str) -> dict[str, Any]:
    """The chart's values.yaml with the ci file on top (maps merged, null deletes)."""

    def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in top.items():
            if value is None:
                out.pop(key, None)
            elif isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
        return out

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(defaults, yaml.safe_load(values_file(name).read_text()) or {})


@cache
def render(
    name: str, monitoring: bool = False, cert_manager: bool = False, extra: str = ""
) -> tuple[dict[str, Any], ...]:
    """``helm template`` with ci/<name>-values.yaml, the APIs the cluster is said to serve, and
    ``extra`` (YAML) on top."""
    args: list[str | Path] = ["template", RELEASE, CHART, "-n", NAMESPACE, "-f", values_file(name)]
    if monitoring:
        args += ["--api-versions", SERVICE_MONITOR_API]
    if cert_manager:
        args += ["--api-versions", CERT_MANAGER_API]
    if extra:
        args += ["-f", "-"]
    result = subprocess.run(
        [helm_binary(), *args],
        input=extra or None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"helm template with {name}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = objects(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def service(docs: tuple[dict[str, Any], ...], component: str = "coordinator") -> dict[str, Any]:
    """The one Service of ``component`` (``coordinator``: the clients'; ``coordinator-metrics``:
    the headless one Prometheus scrapes)."""
    found = [
        d
        for d in objects(docs, "Service")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {component} Service, got {len(found)}"
    return found[0]


def ms_coordinator(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (config_map,) = [d for d in objects(docs, "ConfigMap") if "ms_coordinator.json" in d["data"]]
    return json.loads(config_map["data"]["ms_coordinator.json"])


def pod_specs(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """Every pod template by role: coordinator, head, prefill, decode."""
    cluster = one(docs, "RayCluster")["spec"]
    pods = {"coordinator": one(docs, "Deployment")["spec"]["template"]["spec"]}
    pods["head"] = cluster["headGroupSpec"]["template"]["spec"]
    for group in cluster["workerGroupSpecs"]:
        pods[group["groupName"]] = group["template"]["spec"]
    return pods


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's OpenAPI v3 schema as JSON Schema: int-or-string as anyOf, nullable as a null type,
    and unknown fields refused wherever the schema lists properties and does not preserve them."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {key: structural(sub) for key, sub in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = structural(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [structural(sub) for sub in out[key]]
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


FORMATS = jsonschema.FormatChecker()
for _name, (_low, _high) in INT_RANGES.items():
    FORMATS.checks(_name)(
        lambda value, low=_low, high=_high: not isinstance(value, int) or low <= value <= high
    )


def crd_errors(validator: jsonschema.protocols.Validator, obj: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(obj)
    ]


def server_probe_paths() -> tuple[str, ...]:
    """``PROBES`` of coordinator/server.py, read without importing Ray and torch."""
    tree = ast.parse((ROOT / "coordinator" / "server.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PROBES":
            return ast.literal_eval(node.value)
    raise AssertionError("coordinator/server.py has no PROBES")


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def ray_reads_auth_env() -> tuple[str, str]:
    """The names of the auth mode and token variables, read from the installed ray's sources
    (importing ray is not needed)."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "ray is not installed"
    root = Path(spec.origin).parent
    setup = (root / "_private" / "authentication" / "authentication_token_setup.py").read_text()
    (mode,) = re.findall(r'^AUTH_MODE_ENV_VAR = "(\w+)"', setup, re.M)
    assert '"RAY_AUTH_TOKEN"' in (root / "_private" / "runtime_env" / "image_uri.py").read_text()
    return mode, "RAY_AUTH_TOKEN"


def ports_of(rule: dict[str, Any]) -> set[int]:
    out: set[int] = set()
    for port in rule.get("ports", []):
        out |= set(range(port["port"], port.get("endPort", port["port"]) + 1))
    return out


def policy(docs: tuple[dict[str, Any], ...], suffix: str) -> dict[str, Any]:
    (found,) = [
        d for d in objects(docs, "NetworkPolicy") if d["metadata"]["name"].endswith(f"-{suffix}")
    ]
    return found["spec"]


def admitted(spec: dict[str, Any], port: int) -> list[dict[str, Any]]:
    """The peers any rule of the policy admits to ``port``."""
    return [peer for rule in spec["ingress"] if port in ports_of(rule) for peer in rule["from"]]


def reached(spec: dict[str, Any], port: int, protocol: str = "TCP") -> list[dict[str, Any]]:
    """The peers any egress rule of the policy lets the pods reach on ``port``."""
    return [
        peer
        for rule in spec.get("egress", [])
        if any(
            p.get("protocol", "TCP") == protocol
            and p["port"] <= port <= p.get("endPort", p["port"])
            for p in rule["ports"]
        )
        for peer in rule["to"]
    ]
