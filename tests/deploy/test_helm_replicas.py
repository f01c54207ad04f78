"""The chart's coordinator replicas (docs/replicas.md): several coordinator pods over one shared
pool of workers, a PodDisruptionBudget, readiness that means "has found the pool", and a rolling
upgrade of the coordinators that leaves every worker pod as it was."""

from __future__ import annotations

import pytest

from tests.support.helm_chart import (
    NAMES,
    RELEASE,
    ms_coordinator,
    objects,
    one,
    render,
    server_probe_paths,
    values_of,
)


def fullname(docs: tuple[dict, ...]) -> str:
    return one(docs, "Deployment")["metadata"]["name"]


@pytest.mark.parametrize("name", NAMES)
def test_every_replica_serves_from_one_named_pool(name: str) -> None:
    docs, values = render(name), values_of(name)
    backend = ms_coordinator(docs)["backend_config"]
    assert backend["cluster_name"] == fullname(docs)  # the release's own pool
    assert not backend.get("own_workers")  # no coordinator stops the workers as it goes
    deployment = one(docs, "Deployment")["spec"]
    assert deployment["replicas"] == values["coordinator"]["replicas"]
    strategy = deployment["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    (container,) = deployment["template"]["spec"]["containers"]
    readiness = container["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/v1/readiness" and readiness["path"] in server_probe_paths()


def test_a_cluster_name_of_ones_own_is_kept() -> None:
    docs = render("defaults", extra="msCoordinator: {backend_config: {cluster_name: shared}}")
    assert ms_coordinator(docs)["backend_config"]["cluster_name"] == "shared"


def test_two_coordinators_by_default_with_a_disruption_budget() -> None:
    assert values_of("defaults")["coordinator"]["replicas"] == 2
    docs = render("defaults")
    budget = one(docs, "PodDisruptionBudget")
    deployment = one(docs, "Deployment")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_one_coordinator_has_no_disruption_budget() -> None:
    assert objects(render("minimal"), "PodDisruptionBudget") == []
    off = render("defaults", extra="coordinator: {podDisruptionBudget: {enabled: false}}")
    assert objects(off, "PodDisruptionBudget") == []


def test_upgrading_the_coordinators_leaves_the_workers_as_they_were() -> None:
    """A coordinator setting changes the coordinator pods (their config checksum) and leaves the
    RayCluster, so KubeRay restarts no worker pod, and the pool keeps its name."""
    before = render("defaults")
    after = render(
        "defaults",
        extra="msCoordinator: {log_info: {log_level: DEBUG}, request_limit: {max_requests: 50}}",
    )
    annotation = "checksum/config"
    pod_of = lambda docs: one(docs, "Deployment")["spec"]["template"]["metadata"]  # noqa: E731
    assert pod_of(before)["annotations"][annotation] != pod_of(after)["annotations"][annotation]
    assert one(before, "RayCluster") == one(after, "RayCluster")
    name_of = lambda docs: ms_coordinator(docs)["backend_config"]["cluster_name"]  # noqa: E731
    assert name_of(before) == name_of(after) == f"{RELEASE}-pdserve"
