"""The multi-host test bed is a faithful miniature of the chart's KubeRay deployment: its Ray nodes
start with the ports, custom resources and token authentication the chart renders, its actors
ask for the resources the chart's configuration gives them, and its coordinator takes the
chart's KV settings (``kv_host: auto``, ``kv_encryption: on``). Reads both; needs helm, not
namespaces."""

from __future__ import annotations

import json

from testbed.ray_hosts import (
    BED_START_PARAMS,
    CHART_BACKEND,
    CHART_HEAD_PARAMS,
    ROLE_RESOURCES,
    RayOnHosts,
    worker_params,
)
from tests.support.helm_chart import ms_coordinator, one, render


def _groups() -> dict[str, dict]:
    cluster = one(render("defaults"), "RayCluster")["spec"]
    return {
        "head": cluster["headGroupSpec"],
        **{g["groupName"]: g for g in cluster["workerGroupSpecs"]},
    }


def test_ray_nodes_start_as_the_chart_starts_them():
    groups = _groups()
    assert set(groups) == {"head", *ROLE_RESOURCES}
    assert groups["head"]["rayStartParams"] == CHART_HEAD_PARAMS
    for role in ROLE_RESOURCES:
        rendered = dict(groups[role]["rayStartParams"])
        resources = json.loads(json.loads(rendered.pop("resources")))  # a quoted JSON string
        expected = dict(worker_params(role))
        assert json.loads(expected.pop("resources")) == resources
        assert rendered == expected


def test_the_bed_adds_to_the_charts_parameters_and_overrides_none():
    assert not set(BED_START_PARAMS["head"]) & set(CHART_HEAD_PARAMS)
    for role in ROLE_RESOURCES:
        assert not set(BED_START_PARAMS["worker"]) & set(worker_params(role))


def test_ray_token_authentication_as_in_the_chart():
    for role, group in _groups().items():
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", role
        assert "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"], role
    bed = RayOnHosts(bed=None).env  # type: ignore[arg-type] - the environment needs no hosts
    assert bed["RAY_AUTH_MODE"] == "token" and len(bed["RAY_AUTH_TOKEN"]) >= 32


def test_the_coordinator_takes_the_charts_kv_settings_and_resources():
    backend = ms_coordinator(render("defaults"))["backend_config"]
    assert {key: backend[key] for key in CHART_BACKEND} == CHART_BACKEND
    for role, resource in ROLE_RESOURCES.items():
        assert set(backend[f"{role}_resources"]["resources"]) == {resource}
