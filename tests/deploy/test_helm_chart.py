"""The Helm chart ``deploy/helm/pdserve``, checked with the real helm binary.

``helm lint --strict``; ``helm template`` over every ``ci/*-values.yaml`` (with and without the
Prometheus Operator's ServiceMonitor API); every built-in object validated offline by
kubernetes-validate in strict mode (a kind it does not know is a failure); every RayCluster
validated against the ``openAPIV3Schema`` of KubeRay's CRD
(``../shared/kuberay-crds/ray.io_rayclusters.yaml``; without it those tests skip locally and
fail in CI) with unknown fields rejected, as the API server's strict field validation does (CEL
``x-kubernetes-validations`` rules are not evaluated); the values schema rejects wrong types;
and the rendered ``ms_coordinator.json`` loads with pdserve's own loader and agrees with the
Service, the probes and the mounts.

helm comes from ``scripts/fetch_helm.py`` (run by ``scripts/install.sh``) or ``PATH``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from coordinator.config.loader import SCHEMA, check_manage_listener, load_config
from coordinator.pool.fleet import COORDINATOR_NODE, NODE_ROLE_LABEL
from coordinator.served_model import ServedModels, cluster_config
from tests.support.helm_chart import (
    BUILTIN_KINDS,
    CASE_IDS,
    CASES,
    CHART,
    CI_VALUES,
    CRDS,
    CUSTOM_KINDS,
    FORMATS,
    IMAGE_GID,
    IMAGE_HOME,
    IMAGE_UID,
    KUBE_VERSIONS,
    NAMES,
    NAMESPACE,
    RELEASE,
    ROOT,
    WRITABLE_PATHS,
    admitted,
    crd_errors,
    env_of,
    ms_coordinator,
    objects,
    one,
    pod_specs,
    policy,
    ray_reads_auth_env,
    reached,
    render,
    run_helm,
    server_probe_paths,
    service,
    structural,
    values_of,
)
from tests.support.prerequisites import require


@pytest.fixture(scope="module")
def raycluster_validator() -> jsonschema.protocols.Validator:
    crd_file = CRDS / "ray.io_rayclusters.yaml"
    require(crd_file.is_file(), f"KubeRay's RayCluster CRD {crd_file} (shared/ beside the clone)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(crd_file.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = structural(version["schema"]["openAPIV3Schema"])
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft7Validator(schema, format_checker=FORMATS)


def test_chart_metadata_follows_pyproject() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (chart["apiVersion"], chart["name"], chart["appVersion"]) == ("v2", "pdserve", version)


@pytest.mark.parametrize(
    "values", [None, *CI_VALUES], ids=["chart-defaults", *[p.stem for p in CI_VALUES]]
)
def test_helm_lint_strict(values: Path | None) -> None:
    result = run_helm("lint", "--strict", CHART, *(["-f", values] if values else []))
    assert result.returncode == 0, result.stdout + result.stderr


def test_values_yaml_documents_every_key() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = [
        f"{number}: {line.strip()}"
        for number, line in enumerate(lines, 1)
        if re.match(r"^\s*[\w.-]+:", line)
        and "#" not in line
        and not lines[number - 2].lstrip().startswith("#")
    ]
    assert not undocumented, "values.yaml keys without a comment:\n" + "\n".join(undocumented)


def test_values_schema_only_uses_pdserve_config_keys() -> None:
    """Every ms_coordinator.json key the chart accepts is one pdserve's loader knows."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    sections = schema["properties"]["msCoordinator"]["properties"]
    for section, spec in sections.items():
        assert section in SCHEMA, f"msCoordinator.{section} is no section of coordinator.config"
        assert spec["additionalProperties"] is False
        unknown = set(spec["properties"]) - set(SCHEMA[section])
        assert not unknown, f"msCoordinator.{section}: keys pdserve would ignore: {unknown}"
        for key, key_schema in spec["properties"].items():
            pd_key = SCHEMA[section][key]
            if pd_key.low is not None:
                assert (key_schema["minimum"], key_schema["maximum"]) == (pd_key.low, pd_key.high)
            if pd_key.choices:
                assert key_schema["enum"] == list(pd_key.choices)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"prefill": {"replicas": "two"}}, "/prefill/replicas"),
        ({"msCoordinator": {"backend_config": {"maxSeqLen": "long"}}}, "maxSeqLen"),
        ({"msCoordinator": {"http_config": {"predict_port": 80}}}, "predict_port"),
        ({"msCoordinator": {"http_config": {"predict_prot": 1025}}}, "predict_prot"),
        ({"decode": {"resources": {"gpu": 0.5}}}, "/decode/resources/gpu"),
        ({"replica": 3}, "replica"),
        ({"ray": {"authMode": "password"}}, "authMode"),
        ({"networkPolicy": {"predictFrom": [{"podSelectr": {}}]}}, "podSelectr"),
        ({"networkPolicy": {"predictFrom": [{"ipBlock": {}}]}}, "cidr"),
        ({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "kind"),
        ({"networkPolicy": {"egress": {"dnsPorts": [0]}}}, "dnsPorts"),
        ({"networkPolicy": {"egress": {"extraRules": [{"to": [], "port": 80}]}}}, "port"),
        ({"coordinator": {"replicas": 0}}, "/coordinator/replicas"),
        ({"msCoordinator": {"backend_config": {"cluster_name": "a b"}}}, "cluster_name"),
    ],
    ids=[
        "string-replicas",
        "string-int",
        "port-range",
        "typo-key",
        "float-gpu",
        "unknown-top",
        "auth-mode",
        "peer-typo",
        "peer-cidr",
        "issuer-kind",
        "egress-dns-port",
        "egress-rule-typo",
        "no-coordinator",
        "cluster-name",
    ],
)
def test_values_schema_rejects_bad_values(tmp_path: Path, values: dict, named: str) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(values))
    for args in (["template", RELEASE, CHART], ["lint", "--strict", CHART]):
        result = run_helm(*args, "-f", bad)
        assert result.returncode != 0, f"helm {args[0]} accepted {values}"
        assert named in result.stdout + result.stderr, result.stdout + result.stderr


def test_replicas_outside_min_max_fail_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump({"decode": {"replicas": 9, "maxReplicas": 4}}))
    result = run_helm("template", RELEASE, CHART, "-f", bad)
    assert result.returncode != 0
    assert "decode.replicas (9) must lie in" in result.stderr


def test_grafana_dashboard_is_the_chart_file() -> None:
    dashboard = CHART / "dashboards" / "pdserve.json"
    content = json.loads(dashboard.read_text())
    assert (content["title"], content["uid"]) == ("pdserve", "pdserve")
    link = ROOT / "deploy" / "grafana" / "pdserve.json"
    assert link.is_symlink() and not os.readlink(link).startswith("/")
    assert link.resolve() == dashboard.resolve()
    (config_map,) = [
        d for d in objects(render("defaults"), "ConfigMap") if "pdserve.json" in d["data"]
    ]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["pdserve.json"]) == content
    monitored = [
        d for d in objects(render("monitoring-on"), "ConfigMap") if "pdserve.json" in d["data"]
    ]
    assert monitored[0]["metadata"]["labels"]["grafana_dashboard"] == "pdserve"
    assert monitored[0]["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
    assert not [d for d in objects(render("minimal"), "ConfigMap") if "pdserve.json" in d["data"]]


@pytest.mark.parametrize(("name", "monitoring"), CASES, ids=CASE_IDS)
def test_builtin_objects_pass_kubernetes_validate_strict(name: str, monitoring: bool) -> None:
    docs = render(name, monitoring)
    builtin = [d for d in docs if (d["apiVersion"], d["kind"]) not in CUSTOM_KINDS]
    assert {d["kind"] for d in builtin} <= BUILTIN_KINDS
    for doc in builtin:
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as exc:
                pytest.fail(f"{doc['kind']} was skipped by kubernetes-validate: {exc.message}")
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(map(str, exc.path))
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} ({version}) {path}: {exc.message}"
                )


@pytest.mark.parametrize(("name", "monitoring"), CASES, ids=CASE_IDS)
def test_raycluster_matches_kuberay_crd(raycluster_validator, name: str, monitoring: bool) -> None:
    cluster = one(render(name, monitoring), "RayCluster")
    assert crd_errors(raycluster_validator, cluster) == []
    assert [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] == ["prefill", "decode"]


def test_crd_validation_catches_mistakes(raycluster_validator) -> None:
    """The CRD check is not vacuous: wrong types and unknown fields are refused."""
    cluster = json.loads(json.dumps(one(render("defaults"), "RayCluster")))
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    cluster["spec"]["workerGroupSpec"] = []
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "cpu"
    ] = [1]
    errors = "\n".join(crd_errors(raycluster_validator, cluster))
    assert "workerGroupSpecs.0.replicas" in errors
    assert "workerGroupSpec" in errors and "Additional properties" in errors
    assert "limits.cpu" in errors


def test_kubernetes_validate_strict_catches_unknown_fields() -> None:
    deployment = json.loads(json.dumps(one(render("defaults"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(("name", "monitoring"), CASES, ids=CASE_IDS)
def test_service_monitor_only_with_the_operator_api(name: str, monitoring: bool) -> None:
    docs = render(name, monitoring)
    monitors = objects(docs, "ServiceMonitor")
    enabled = values_of(name)["monitoring"]["serviceMonitor"]["enabled"]
    assert len(monitors) == (1 if enabled and monitoring else 0)
    if monitors:
        scraped = service(render(name, monitoring), "coordinator-metrics")
        spec = monitors[0]["spec"]
        assert spec["selector"]["matchLabels"].items() <= scraped["metadata"]["labels"].items()
        assert (
            not spec["selector"]["matchLabels"].items()
            <= service(docs)["metadata"]["labels"].items()
        )
        (endpoint,) = spec["endpoints"]
        assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
        assert monitors[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("name", NAMES)
def test_ms_coordinator_json_loads_with_pdserve(tmp_path: Path, name: str) -> None:
    docs, values = render(name), values_of(name)
    config_file = tmp_path / "ms_coordinator.json"
    config_file.write_text(json.dumps(ms_coordinator(docs)))
    config = load_config(config_file)
    http, backend = config["http_config"], config["backend_config"]
    for key, value in values["msCoordinator"]["http_config"].items():
        assert http[key] == (tuple(value) if isinstance(value, list) else value), key
    cluster_name = f"{values['fullnameOverride'] or f'{RELEASE}-pdserve'}-ray"
    assert one(docs, "RayCluster")["metadata"]["name"] == cluster_name
    # KubeRay names the head Service "<RayCluster>-head-svc"; 6379 is the GCS port.
    assert backend["ray_address"] == f"{cluster_name}-head-svc.{NAMESPACE}.svc:6379"
    assert backend["model_path"] == values["msCoordinator"]["backend_config"]["model_path"]
    scheduler = values["msCoordinator"]["digs_scheduler_config"]
    assert config["digs_scheduler_config"]["deploy_mode"] == scheduler["deploy_mode"]
    assert config["tls_config"]["request_server_tls_enable"] == values["tls"]["enabled"]
    # Decode pods advertise their own IP; each role's actors ask for their group's resource,
    # and the actor placement the cluster computes from the config agrees.
    assert backend["kv_host"] == "auto"
    cluster = cluster_config(config, ServedModels(None, None))
    assert backend["kv_encryption"] == "on" and cluster.kv.encrypted  # between pods
    groups = {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    for role, resources in (
        ("prefill", cluster.prefill_resources),
        ("decode", cluster.decode_resources),
    ):
        offered = groups[role]["rayStartParams"].get("resources", "{}")
        wanted = {f"pdserve_{role}": 1.0} if f"pdserve_{role}" in offered else {}
        assert dict(resources.resources) == wanted
        assert resources.num_gpus == values[role]["resources"]["gpu"]


@pytest.mark.parametrize("name", NAMES)
def test_coordinator_agrees_with_its_config(name: str) -> None:
    docs, values = render(name), values_of(name)
    http = ms_coordinator(docs)["http_config"]
    ports = {"predict": "predict_port", "manage": "manage_port", "status": "status_port"}
    ports["metrics"] = "external_port"
    # The clients' ports alone are on the Service, the management port only when asked for;
    # the probes reach the pod, Prometheus the headless metrics Service.
    on_service = {"predict": "predict_port"}
    if values["coordinator"]["service"]["exposeManagePort"]:
        on_service["manage"] = "manage_port"
    clients = service(docs)
    assert {p["name"]: p["port"] for p in clients["spec"]["ports"]} == {
        name: http[key] for name, key in on_service.items()
    }
    scraped = service(docs, "coordinator-metrics")
    assert scraped["spec"]["clusterIP"] == "None"
    assert scraped["spec"]["selector"] == clients["spec"]["selector"]
    assert [(p["name"], p["port"]) for p in scraped["spec"]["ports"]] == [
        ("metrics", http["external_port"])
    ]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        name: http[key] for name, key in ports.items()
    }
    script = container["args"][0]
    assert 'exec pdserve --config "$CONFIG"' in script
    assert "CONFIG=/etc/pdserve/ms_coordinator.json" in script
    # The raylet of the coordinator listens on the fixed Ray ports the NetworkPolicies name.
    flags = dict(re.findall(r"--([a-z-]+-port) (\d+)", script))
    head_params = one(docs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    for flag, port in flags.items():
        assert head_params[flag] == port, flag
    assert len(flags) == 8
    # its node carries the label that keeps the CPU-less embedder off it
    label = f"--labels {NODE_ROLE_LABEL}={COORDINATOR_NODE}"
    assert label in script and "--num-cpus 0" in script
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RAY_ADDRESS"] == ms_coordinator(docs)["backend_config"]["ray_address"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "status" and get["path"] in server_probe_paths(), probe
    config_mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config"}
    assert "/etc/pdserve/ms_coordinator.json" in config_mounts


@pytest.mark.parametrize("name", NAMES)
def test_tls_config_points_at_the_mounted_secret(name: str) -> None:
    docs, values = render(name), values_of(name)
    tls = ms_coordinator(docs)["tls_config"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    if not values["tls"]["enabled"]:
        assert tls == {"request_server_tls_enable": False}
        assert "tls" not in volumes and "tls" not in mounts
        return
    secret_name = volumes["tls"]["secret"]["secretName"]
    expected = {"tls_cert": "tls.crt", "tls_key": "tls.key"}
    if values["tls"]["caCert"]:  # mutual TLS
        expected["ca_cert"] = "ca.crt"
    else:
        assert "ca_cert" not in tls
    for key, file in expected.items():
        assert tls[key] == f"{mounts['tls']}/{file}", key
    secrets = [s for s in objects(docs, "Secret") if s["metadata"]["name"] == secret_name]
    if values["tls"]["selfSigned"]:  # the generated Secret always carries its CA
        assert set(secrets[0]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        assert secrets[0]["type"] == "kubernetes.io/tls"
    else:
        assert secret_name == values["tls"]["secretName"] and not secrets


@pytest.mark.parametrize("name", NAMES)
def test_ray_pods_have_shm_and_the_model_volume(name: str) -> None:
    docs, values = render(name), values_of(name)
    model = values["model"]
    for role, pod in pod_specs(docs).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[
            [
                m["name"]
                for m in pod["containers"][0]["volumeMounts"]
                if m["mountPath"] == "/dev/shm"
            ][0]
        ]
        assert shm["emptyDir"]["medium"] == "Memory", role
        if role != "coordinator":
            assert shm["emptyDir"]["sizeLimit"] == values[role]["shmSize"], role
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        if model["type"] == "none":
            assert "model" not in volumes, role
            continue
        assert mounts["model"] == model["mountPath"], role
        if model["type"] == "persistentVolumeClaim":
            assert volumes["model"]["persistentVolumeClaim"]["claimName"] == model["claimName"]
        else:
            assert volumes["model"]["hostPath"]["path"] == model["hostPath"]


@pytest.mark.parametrize("name", NAMES)
def test_worker_groups_follow_values(name: str) -> None:
    docs, values = render(name), values_of(name)
    cluster = one(docs, "RayCluster")["spec"]
    gpu_name = values["ray"]["gpuResourceName"]
    for group in cluster["workerGroupSpecs"]:
        wanted = values[group["groupName"]]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
            wanted["replicas"],
            wanted["minReplicas"],
            wanted["maxReplicas"],
        )
        pod = group["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        assert resources["requests"] == resources["limits"]
        assert resources["limits"]["cpu"] == str(wanted["resources"]["cpu"])
        assert resources["limits"]["memory"] == wanted["resources"]["memory"]
        assert resources["limits"].get(gpu_name, 0) == wanted["resources"]["gpu"]
        assert pod.get("nodeSelector", {}) == wanted["nodeSelector"]
        assert pod.get("tolerations", []) == wanted["tolerations"]
        params = group["rayStartParams"]
        if wanted["rayResources"]:
            # KubeRay passes the value as is to `ray start --resources=`; the shell unquotes it.
            assert json.loads(json.loads(params["resources"])) == wanted["rayResources"]
        else:
            assert "resources" not in params
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_gpu_workers_ask_for_gpus() -> None:
    cluster = one(render("gpu-workers"), "RayCluster")["spec"]
    for group in cluster["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 1
        assert group["template"]["spec"]["nodeSelector"]["pdserve.io/role"] == group["groupName"]
    assert cluster["enableInTreeAutoscaling"] is True


@pytest.mark.parametrize("name", NAMES)
def test_ray_token_auth_reaches_every_ray_process(name: str) -> None:
    docs, values = render(name), values_of(name)
    ray = values["ray"]
    cluster = one(docs, "RayCluster")["spec"]
    pods = pod_specs(docs)
    containers = {role: pod["containers"][0] for role, pod in pods.items()}
    mode_var, token_var = ray_reads_auth_env()
    if ray["authMode"] != "token":
        assert cluster.get("authOptions", {}).get("mode", "") == ray["authMode"]
        assert "secretName" not in cluster.get("authOptions", {})
        for role, container in containers.items():
            assert token_var not in env_of(container), role
        return
    secret_name = ray["authSecret"]["name"] or f"{RELEASE}-pdserve-ray-auth"
    key = ray["authSecret"]["key"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": secret_name}
    sidecars = {}
    if ray["enableInTreeAutoscaling"]:
        sidecars["autoscaler"] = cluster["autoscalerOptions"]
    for role, container in {**containers, **sidecars}.items():
        env = env_of(container)
        assert env[mode_var]["value"] == "token", role
        ref = env[token_var]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret_name, key), role
    generated = [s for s in objects(docs, "Secret") if s["metadata"]["name"] == secret_name]
    if ray["authSecret"]["name"]:
        assert not generated, "an existing Secret is named: the chart creates none"
    else:
        (secret,) = generated
        token = base64.b64decode(secret["data"][key]).decode()
        assert len(token) >= 32 and token.isalnum()


def test_ray_token_is_generated_once() -> None:
    """The generated token is random per rendering, and an upgrade keeps the Secret's token:
    the template looks the Secret up and reuses its data."""
    first, second = render("defaults"), render("defaults", extra="{}\n")
    name = f"{RELEASE}-pdserve-ray-auth"
    tokens = [
        [s for s in objects(docs, "Secret") if s["metadata"]["name"] == name][0]["data"]
        for docs in (first, second)
    ]
    assert tokens[0] != tokens[1]
    template = (CHART / "templates" / "ray-auth-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert '$token := dig "data" $key "" $existing' in template
    assert "$token | default (randAlphaNum" in template


@pytest.mark.parametrize("name", NAMES)
def test_ray_dashboard_listens_on_loopback(name: str) -> None:
    params = one(render(name), "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "127.0.0.1"


def _policy_peers(docs: list[dict], cluster_name: str) -> dict[str, dict]:
    """The NetworkPolicy peers the policies admit: the coordinator, the Ray workers, the prefill
    pods and every Ray pod, by their pod selectors."""
    return {
        "coordinator": {"podSelector": {"matchLabels": service(docs)["spec"]["selector"]}},
        "workers": {
            "podSelector": {
                "matchLabels": {"ray.io/cluster": cluster_name, "ray.io/node-type": "worker"}
            }
        },
        "prefill": {
            "podSelector": {
                "matchLabels": {"ray.io/cluster": cluster_name, "ray.io/group": "prefill"}
            }
        },
        "ray_pods": {"podSelector": {"matchLabels": {"ray.io/cluster": cluster_name}}},
    }


def _assert_the_coordinator_policy(docs: list[dict], values: dict, peers: dict) -> None:
    """The coordinator: predict and status from predictFrom, manage from nobody unless exposed."""
    np, http = values["networkPolicy"], values["msCoordinator"]["http_config"]
    spec = policy(docs, "coordinator")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert admitted(spec, http["predict_port"]) == np["predictFrom"]
    assert admitted(spec, http["status_port"]) == np["predictFrom"]
    assert admitted(spec, http["external_port"]) == np["metricsFrom"]
    manage = admitted(spec, http["manage_port"])
    if values["coordinator"]["service"]["exposeManagePort"]:
        assert manage == np["manageFrom"]
    else:
        assert manage == []
    assert admitted(spec, values["ray"]["ports"]["nodeManager"]) == [peers["ray_pods"]]


def _assert_the_ray_head_policy(docs: list[dict], cluster_name: str, peers: dict) -> None:
    """The head: GCS from the coordinator and the workers, the client port from the coordinator
    only, the dashboard from nobody."""
    spec = policy(docs, "ray-head")
    assert spec["podSelector"]["matchLabels"] == {
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": "head",
    }
    assert admitted(spec, 6379) == [peers["coordinator"], peers["workers"]]
    assert admitted(spec, 10001) == [peers["coordinator"]]
    assert admitted(spec, 8265) == []


def _assert_the_ray_worker_policies(
    docs: list[dict], values: dict, cluster_name: str, peers: dict
) -> None:
    """Decode: the KV ports from prefill pods only, no Ray port among them; every group: its Ray
    ports from the coordinator and Ray pods, the predict port from nobody."""
    np, ray_ports = values["networkPolicy"], values["ray"]["ports"]
    spec = policy(docs, "ray-decode")
    kv = range(np["kvPorts"]["start"], np["kvPorts"]["end"] + 1)
    for port in (kv.start, kv.stop - 1, 49152, 60999):
        assert admitted(spec, port) == [peers["prefill"]], port
    assert all(port < kv.start for port in ray_ports.values())
    groups = [g["groupName"] for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]]
    for role in groups:
        spec = policy(docs, f"ray-{role}")
        assert spec["podSelector"]["matchLabels"] == {
            "ray.io/cluster": cluster_name,
            "ray.io/group": role,
        }
        for port in (ray_ports["objectManager"], ray_ports["minWorker"], ray_ports["maxWorker"]):
            assert admitted(spec, port) == [peers["coordinator"], peers["ray_pods"]], (role, port)
        predict_port = values["msCoordinator"]["http_config"]["predict_port"]
        assert admitted(spec, predict_port) == []


@pytest.mark.parametrize("name", NAMES)
def test_network_policies(name: str) -> None:
    docs, values = render(name), values_of(name)
    np = values["networkPolicy"]
    if not np["enabled"]:
        assert not objects(docs, "NetworkPolicy")
        return
    cluster_name = one(docs, "RayCluster")["metadata"]["name"]
    peers = _policy_peers(docs, cluster_name)
    assert len(objects(docs, "NetworkPolicy")) == 4
    for doc in objects(docs, "NetworkPolicy"):
        assert doc["spec"]["policyTypes"] == ["Ingress", "Egress"]
    _assert_the_coordinator_policy(docs, values, peers)
    _assert_the_ray_head_policy(docs, cluster_name, peers)
    _assert_the_ray_worker_policies(docs, values, cluster_name, peers)


def test_network_policy_sources_follow_values() -> None:
    values = values_of("network")
    docs = render("network")
    spec = policy(docs, "coordinator")
    http = values["msCoordinator"]["http_config"]
    assert admitted(spec, http["predict_port"])[1] == {"ipBlock": {"cidr": "10.20.0.0/16"}}
    assert admitted(spec, http["manage_port"]) == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert "manage" in {p["name"] for p in service(docs)["spec"]["ports"]}


@pytest.mark.parametrize("name", [n for n in NAMES if values_of(n)["networkPolicy"]["enabled"]])
def test_egress_policies(name: str) -> None:
    """Every pod reaches DNS and the Ray mesh; the coordinator also the head's client port, the
    prefill pods the decode pods' KV ports, the head the API server when it autoscales; nothing
    else but the extra rules."""
    docs, values = render(name), values_of(name)
    np, ray_ports = values["networkPolicy"], values["ray"]["ports"]
    egress = np["egress"]
    cluster_name = one(docs, "RayCluster")["metadata"]["name"]
    coordinator = {"podSelector": {"matchLabels": service(docs)["spec"]["selector"]}}
    ray_pods = {"podSelector": {"matchLabels": {"ray.io/cluster": cluster_name}}}
    head = {
        "podSelector": {"matchLabels": {"ray.io/cluster": cluster_name, "ray.io/node-type": "head"}}
    }
    decode = {
        "podSelector": {"matchLabels": {"ray.io/cluster": cluster_name, "ray.io/group": "decode"}}
    }
    extra_ports = {p["port"] for rule in egress["extraRules"] for p in rule["ports"]}
    extra = [peer for rule in egress["extraRules"] for peer in rule["to"]]
    kv = (np["kvPorts"]["start"], np["kvPorts"]["end"])
    autoscaling = values["ray"]["enableInTreeAutoscaling"]
    for suffix in ("coordinator", "ray-head", "ray-prefill", "ray-decode"):
        spec = policy(docs, suffix)
        for port in egress["dnsPorts"]:
            assert reached(spec, port, "UDP") == egress["dnsTo"], suffix
            assert reached(spec, port, "TCP") == egress["dnsTo"], suffix
        for port in (ray_ports["nodeManager"], ray_ports["objectManager"], ray_ports["maxWorker"]):
            assert reached(spec, port) == [coordinator, ray_pods], (suffix, port)
        assert reached(spec, 6379) == [head], suffix
        assert reached(spec, 10001) == ([head] if suffix == "coordinator" else []), suffix
        for port in kv:
            assert reached(spec, port) == ([decode] if suffix == "ray-prefill" else []), suffix
        for port in egress["apiServerPorts"]:
            api = egress["apiServerTo"] if suffix == "ray-head" and autoscaling else []
            assert reached(spec, port) == api, (suffix, port)
        for port in extra_ports:
            assert reached(spec, port)[-len(extra) :] == extra, (suffix, port)
        # Nothing else: not the web, not the predict ports of other services.
        for port in (80, 8443, 1025, 8265):
            assert reached(spec, port) == [], (suffix, port)


def test_egress_can_be_left_open() -> None:
    docs = render("defaults", extra="networkPolicy: {egress: {enabled: false}}")
    for doc in objects(docs, "NetworkPolicy"):
        assert doc["spec"]["policyTypes"] == ["Ingress"]
        assert "egress" not in doc["spec"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"coordinator": {"service": {"type": "LoadBalancer"}}}, "type LoadBalancer exposes"),
        ({"coordinator": {"service": {"type": "NodePort"}}}, "type NodePort exposes"),
        (
            {"networkPolicy": {"predictFrom": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}},
            "admits ipBlock 0.0.0.0/0",
        ),
        (
            {
                "networkPolicy": {
                    "predictFrom": [{"podSelector": {}}, {"ipBlock": {"cidr": "10.20.0.0/16"}}]
                }
            },
            "admits ipBlock 10.20.0.0/16",
        ),
        (  # the CA without TLS is no client authentication
            {
                "coordinator": {"service": {"type": "LoadBalancer"}},
                "tls": {"enabled": False, "caCert": True},
            },
            "type LoadBalancer exposes",
        ),
    ],
    ids=["load-balancer", "node-port", "ip-block-any", "ip-block-cidr", "ca-without-tls"],
)
def test_outside_exposure_without_credentials_fails(
    tmp_path: Path, extra: dict, message: str
) -> None:
    # helm lint reports a template's `fail` as INFO only; template (and install) stop on it.
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump(extra))
    result = run_helm("template", RELEASE, CHART, "-f", bad)
    assert result.returncode != 0, f"helm template accepted {extra}"
    assert message in result.stderr and "apiKeys.secretName" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "extra",
    [
        {"coordinator": {"service": {"type": "LoadBalancer"}}, "apiKeys": {"secretName": "k"}},
        {"coordinator": {"service": {"type": "NodePort"}}, "tls": {"caCert": True}},
        {
            "networkPolicy": {"predictFrom": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]},
            "apiKeys": {"secretName": "k"},
        },
        {"networkPolicy": {"enabled": False}},  # ClusterIP: inside the cluster only
    ],
    ids=["load-balancer-with-keys", "node-port-with-mtls", "ip-block-with-keys", "cluster-ip"],
)
def test_outside_exposure_with_credentials_renders(extra: dict) -> None:
    docs = render("defaults", extra=yaml.safe_dump(extra))
    spec = service(docs)["spec"]
    assert spec["type"] == extra.get("coordinator", {}).get("service", {}).get("type", "ClusterIP")


@pytest.mark.parametrize("name", NAMES)
def test_no_pod_mounts_a_service_account_token(name: str) -> None:
    """Neither the coordinator nor Ray needs the Kubernetes API: no pod automounts the token.
    The autoscaler sidecar does need it: it alone mounts a projected token."""
    docs, values = render(name), values_of(name)
    pods = pod_specs(docs)
    for role, pod in pods.items():
        assert pod["automountServiceAccountToken"] is False, role
        for container in pod.get("initContainers", []) + pod["containers"]:
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/var/run/secrets/kubernetes.io/serviceaccount" not in mounts, role
    cluster = one(docs, "RayCluster")["spec"]
    head_volumes = {v["name"]: v for v in pods["head"]["volumes"]}
    for role in ("coordinator", "prefill", "decode"):
        assert "kube-api-access" not in {v["name"] for v in pods[role]["volumes"]}, role
    if not values["ray"]["enableInTreeAutoscaling"]:
        assert "kube-api-access" not in head_volumes
        assert "autoscalerOptions" not in cluster
        return
    (mount,) = cluster["autoscalerOptions"]["volumeMounts"]
    assert mount == {
        "name": "kube-api-access",
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
        "readOnly": True,
    }
    sources = head_volumes["kube-api-access"]["projected"]["sources"]
    # What Ray's KubeRay node provider reads: token and ca.crt (namespace, as the kubelet's).
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert sources[2]["downwardAPI"]["items"][0]["path"] == "namespace"


@pytest.mark.parametrize("name", NAMES)
def test_pods_run_locked_down(name: str) -> None:
    docs = render(name)
    for role, pod in pod_specs(docs).items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, role
        assert (context["runAsUser"], context["runAsGroup"]) == (IMAGE_UID, IMAGE_GID), role
        assert context["fsGroup"] == IMAGE_GID, role
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, role
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{role}/{container['name']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"] == {"drop": ["ALL"]}, where
            assert security["readOnlyRootFilesystem"] is True, where
        (container,) = pod["containers"]
        scratch = {
            m["mountPath"]: m["name"]
            for m in container["volumeMounts"]
            if "emptyDir" in volumes[m["name"]]
        }
        for path in WRITABLE_PATHS:
            under = [mount for mount in scratch if path == mount or path.startswith(mount + "/")]
            assert under, f"{role}: {path} is on the read-only root filesystem"
        # The caches baked into the image are copied into ~/.cache before the main container.
        if role != "head":
            (seed,) = pod["initContainers"]
            assert seed["name"] == "seed-cache"
            assert seed["volumeMounts"] == [{"name": "cache", "mountPath": f"{IMAGE_HOME}/.cache"}]
            assert f"cp -a /opt/pdserve/cache/. {IMAGE_HOME}/.cache/;" in seed["command"][-1]


def _assert_the_deployment_mounts_the_keys_and_composes_its_config(
    docs: list[dict], values: dict
) -> None:
    """The keys are not in the ConfigMap; the Secret and the compose script are mounted, and the
    container's script composes a private config before it starts pdserve on it."""
    assert "api_keys" not in ms_coordinator(docs)["http_config"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    secret = volumes["api-keys"]["secret"]
    assert secret["secretName"] == values["apiKeys"]["secretName"]
    assert secret["items"] == [{"key": values["apiKeys"]["secretKey"], "path": "api-keys"}]
    assert mounts["/etc/pdserve/api-keys"]["name"] == "api-keys"
    assert mounts["/etc/pdserve/compose_config.py"]["subPath"] == "compose_config.py"
    assert "manage-api-keys" not in volumes
    script = container["args"][0]
    command = (
        'python /etc/pdserve/compose_config.py "$CONFIG" /tmp/pdserve/ms_coordinator.json '
        "--api-keys /etc/pdserve/api-keys/api-keys\n"
    )
    assert command in script
    assert script.index(command) < script.index('exec pdserve --config "$CONFIG"')
    assert "CONFIG=/tmp/pdserve/ms_coordinator.json" in script


def _assert_the_compose_script_merges_the_keys(docs: list[dict], tmp_path: Path) -> None:
    """The script the ConfigMap carries, run on the rendered config and a keys file, writes a
    private config with the keys; an empty keys file fails it."""
    (config_map,) = [d for d in objects(docs, "ConfigMap") if "compose_config.py" in d["data"]]
    compose = tmp_path / "compose_config.py"
    compose.write_text(config_map["data"]["compose_config.py"])
    source, keys, target = tmp_path / "in.json", tmp_path / "keys", tmp_path / "out" / "c.json"
    source.write_text(config_map["data"]["ms_coordinator.json"])
    keys.write_text("k-123\n\n  k-456  \n")
    run = [sys.executable, compose, source, target]
    subprocess.run([*run, "--api-keys", keys], check=True, timeout=30)
    assert load_config(target)["http_config"]["api_keys"] == ("k-123", "k-456")
    assert target.stat().st_mode & 0o777 == 0o600
    keys.write_text("\n")
    empty = subprocess.run([*run, "--api-keys", keys], capture_output=True, timeout=30)
    assert empty.returncode != 0 and b"no API key" in empty.stderr


def test_api_keys_come_from_a_secret(tmp_path: Path) -> None:
    """The keys never land in the ConfigMap: the coordinator merges them from the Secret into a
    private copy of its config at start, with the chart's own script."""
    values = values_of("tls-on")
    docs = render("tls-on")
    _assert_the_deployment_mounts_the_keys_and_composes_its_config(docs, values)

    # Run the script the ConfigMap carries on the rendered config and a keys file.
    _assert_the_compose_script_merges_the_keys(docs, tmp_path)

    # Without a Secret the config is used as rendered.
    defaults = one(render("defaults"), "Deployment")["spec"]["template"]["spec"]
    assert not {"api-keys", "manage-api-keys"} & {v["name"] for v in defaults["volumes"]}
    assert "compose_config.py" not in defaults["containers"][0]["args"][0]


def _assert_the_default_management_api_is_on_loopback(tmp_path: Path) -> None:
    """Defaults: the management API on loopback, not on the Service; the config passes the check."""
    docs = render("defaults")
    assert ms_coordinator(docs)["http_config"]["manage_ip"] == "127.0.0.1"
    assert "manage" not in {p["name"] for p in service(docs)["spec"]["ports"]}
    config_file = tmp_path / "defaults.json"
    config_file.write_text(json.dumps(ms_coordinator(docs)))
    check_manage_listener(load_config(config_file))


def _assert_an_exposed_management_api_gets_its_own_keys(tmp_path: Path) -> None:
    """Exposed: off loopback, with the keys of their own Secret merged in at start."""
    values = values_of("network")
    docs = render("network")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    secret = {v["name"]: v for v in pod["volumes"]}["manage-api-keys"]["secret"]
    assert secret["secretName"] == values["apiKeys"]["manage"]["secretName"]
    assert secret["items"] == [
        {"key": values["apiKeys"]["manage"]["secretKey"], "path": "manage-api-keys"}
    ]
    script = pod["containers"][0]["args"][0]
    assert "--manage-api-keys /etc/pdserve/manage-api-keys/manage-api-keys" in script
    (config_map,) = [d for d in objects(docs, "ConfigMap") if "compose_config.py" in d["data"]]
    compose, source = tmp_path / "compose_config.py", tmp_path / "in.json"
    compose.write_text(config_map["data"]["compose_config.py"])
    source.write_text(config_map["data"]["ms_coordinator.json"])
    keys, target = tmp_path / "manage-keys", tmp_path / "out.json"
    keys.write_text("m-1\n")
    run = [sys.executable, compose, source, target, "--manage-api-keys", keys]
    subprocess.run(run, check=True, timeout=30)
    composed = json.loads(target.read_text())["http_config"]
    assert (composed["manage_ip"], composed["manage_api_keys"]) == ("0.0.0.0", ["m-1"])
    check_manage_listener(load_config(target))


def _assert_exposing_it_without_keys_or_on_loopback_fails(tmp_path: Path) -> None:
    """Exposing the management API without keys, or on loopback, fails the rendering."""
    for extra, message in (
        ({"coordinator": {"service": {"exposeManagePort": True}}}, "manage_ip off loopback"),
        (
            {
                "coordinator": {"service": {"exposeManagePort": True}},
                "msCoordinator": {"http_config": {"manage_ip": "0.0.0.0"}},
            },
            "apiKeys.manage.secretName",
        ),
    ):
        bad = tmp_path / "bad-values.yaml"
        bad.write_text(yaml.safe_dump(extra))
        result = run_helm("template", RELEASE, CHART, "-f", bad)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_management_api_stays_on_loopback_unless_exposed_with_keys(tmp_path: Path) -> None:
    _assert_the_default_management_api_is_on_loopback(tmp_path)
    _assert_an_exposed_management_api_gets_its_own_keys(tmp_path)
    _assert_exposing_it_without_keys_or_on_loopback_fails(tmp_path)


def test_inline_api_keys_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad-values.yaml"
    bad.write_text(yaml.safe_dump({"msCoordinator": {"http_config": {"api_keys": ["k"]}}}))
    result = run_helm("template", RELEASE, CHART, "-f", bad)
    assert result.returncode != 0 and "api_keys" in result.stderr


def test_certificate_from_cert_manager_when_its_api_is_there() -> None:
    docs = render("defaults", cert_manager=True)
    service_name = service(docs)["metadata"]["name"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    secret_name = {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"]
    certificate = one(docs, "Certificate")["spec"]
    issuer = one(docs, "Issuer")
    assert certificate["secretName"] == secret_name
    assert f"{service_name}.{NAMESPACE}.svc" in certificate["dnsNames"]
    assert certificate["issuerRef"] == {
        "name": issuer["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    assert issuer["spec"] == {"selfSigned": {}}
    assert certificate["duration"] == "2160h" and certificate["renewBefore"] == "720h"
    # cert-manager writes the Secret: the chart's generated one is gone; no client certificate
    # is required unless tls.caCert asks for mutual TLS.
    assert not [s for s in objects(docs, "Secret") if s["metadata"]["name"] == secret_name]
    assert "ca_cert" not in ms_coordinator(docs)["tls_config"]
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSIONS[-1], strict=True)

    # Without the API: the generated self-signed Secret, no Certificate.
    plain = render("defaults")
    assert not objects(plain, "Certificate") and not objects(plain, "Issuer")
    assert [s for s in objects(plain, "Secret") if s["metadata"]["name"] == secret_name]
    # A Secret of one's own wins over cert-manager; cert-manager may be turned off.
    assert not objects(render("tls-on", cert_manager=True), "Certificate")
    off = render("defaults", cert_manager=True, extra="tls: {certManager: {enabled: false}}\n")
    assert not objects(off, "Certificate")


def test_cert_manager_with_an_issuer_of_ones_own() -> None:
    issuer = {"certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}
    extra = yaml.safe_dump({"tls": issuer})
    docs = render("defaults", cert_manager=True, extra=extra)
    assert not objects(docs, "Issuer")
    assert one(docs, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    # Mutual TLS only with tls.caCert.
    assert "ca_cert" not in ms_coordinator(docs)["tls_config"]
    with_ca = render(
        "defaults", cert_manager=True, extra=yaml.safe_dump({"tls": {**issuer, "caCert": True}})
    )
    assert "ca_cert" in ms_coordinator(with_ca)["tls_config"]
