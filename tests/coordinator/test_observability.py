"""Observability as operators see it: the coordinator's real ``/metrics`` through ``promtool``, the
Prometheus alert rules and their unit tests, and the Grafana dashboard, whose every query a real
Prometheus answers while it scrapes the running coordinators (the shared three, and one more here
whose decode worker speculates, for the speculative decoding panels)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from tests.support.coordinator_servers import backend, infer
from tests.support.metrics_names import (
    CONSTRAINED,
    DASHBOARD,
    DUPLICATE_FAMILIES,
    FIGURES,
    PLAIN,
    PROMETHEUS_DIR,
    REPEATING,
    STREAMED,
    _api,
    _exprs,
    _families,
    _grafana_to_promql,
    _has_finite_value,
    _metrics,
    _model_names,
    _overload,
    _panels,
    _prometheus,
    _promtool_run,
    _rules_health,
    _sample_names,
    _send,
    _shows,
    _targets_up,
    _traffic,
    _wait_until,
    metric_names,
)


@pytest.fixture(scope="module")
def observed(servers, tmp_path_factory, tiny_model_dir) -> Iterator[dict[str, CoordinatorProcess]]:
    """The shared coordinators and ``speculating``: pd_separate whose decode worker drafts
    (``speculative_method: ngram``, a one-token match enough), whose workers have both KV
    tiers (for the tiers' panels) and are elastic (for the roles' panels)."""
    tiers = tmp_path_factory.mktemp("kv-tiers")
    config = {
        "backend_config": backend(
            tiny_model_dir,
            speculative_method="ngram",
            speculative_min_match=1,
            maxIterTimes=64,  # answers long enough that a request which stopped drafting probes
            elastic_roles=True,  # its workers switch roles (the elastic panels; a switch below)
            kv_host_tier_mb=4,
            kv_host_tier_path=str(tiers / "host"),
            kv_disk_tier_mb=4,
            kv_disk_tier_path=str(tiers / "disk"),
        )
    }
    speculating = start_coordinator(tmp_path_factory.mktemp("speculating"), config)
    try:
        speculating.wait_ready()
        yield {**servers, "speculating": speculating}
    finally:
        assert speculating.stop() == 0


def _speculated(server: CoordinatorProcess) -> bool:
    return "speculative_checks_by_accepted_total{" in _metrics(server)


@pytest.fixture(scope="module")
def exercised(observed) -> dict[str, str]:
    """Each server's /metrics after real traffic: plain and streamed /infer on zmq, /infer with
    the api key on grpc, a request refused for max_requests on single, and prompts that repeat
    to speculating until its decode worker's checks are counted."""
    servers = observed
    zmq, grpc = servers["zmq"], servers["grpc"]
    for server, body in ((zmq, PLAIN), (zmq, STREAMED), (grpc, PLAIN), (grpc, STREAMED)):
        response = infer(server, body)
        assert response.status_code == 200, response.text
    for server in (zmq, grpc, zmq, grpc):  # compiled once at each door, then a cache hit
        response = _send(server, CONSTRAINED)
        assert response.status_code == 200, response.text
    assert httpx.post(grpc.url("predict_port", "/infer"), json=PLAIN).status_code == 401
    _overload(servers["single"])
    speculating = servers["speculating"]

    def speculated() -> bool:
        response = infer(speculating, REPEATING)
        assert response.status_code == 200, response.text
        return _speculated(speculating)

    _wait_until(speculated, 60, "the speculating decode worker's checks in /metrics")
    return {name: _metrics(server) for name, server in servers.items()}


def test_alert_rules_pass_promtool_check_and_their_unit_tests():
    _promtool_run("check", "rules", "alerts.yml")
    _promtool_run("test", "rules", "alerts_test.yml")


def test_alert_unit_tests_cover_every_alert_firing_and_not_firing():
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {
        "PdserveHighTTFT",
        "PdserveKVCacheNearlyFull",
        "PdserveHighErrorRate",
        "PdserveTargetDown",
    } <= alerts
    cases = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())["tests"]
    checks = [c for t in cases for c in t["alert_rule_test"]]
    fired = {c["alertname"] for c in checks if c["exp_alerts"]}
    quiet = {c["alertname"] for c in checks if not c["exp_alerts"]}
    assert fired == alerts and quiet == alerts


def test_example_prometheus_config_is_valid():
    _promtool_run("check", "config", "prometheus.yml")


def test_dashboard_is_grafana_schema_39_with_datasource_and_model_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    assert (dashboard["uid"], dashboard["title"], dashboard["schemaVersion"]) == (
        "pdserve",
        "pdserve",
        39,
    )
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    model = variables["model_name"]
    assert model["type"] == "query" and model["datasource"]["uid"] == "${datasource}"
    assert re.fullmatch(r"label_values\(\w+, model_name\)", model["definition"])
    assert model["query"]["query"] == model["definition"]
    # the coordinator replicas (docs/replicas.md): every panel shows the ones chosen
    coordinator = variables["coordinator"]
    assert coordinator["multi"] and coordinator["includeAll"]
    assert coordinator["definition"].startswith("label_values(coordinator_info{")
    assert coordinator["definition"].endswith(", instance)")
    panels = _panels()
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert {p["type"] for p in panels} == {"timeseries", "stat"}
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            for selector in re.findall(r"\{[^}]*\}", target["expr"]):
                assert 'model_name=~"$model_name"' in selector, target["expr"]
                assert 'instance=~"$coordinator"' in selector, target["expr"]
            for window in re.findall(r"\[[^\]]*\]", target["expr"]):
                assert window == "[$__rate_interval]", target["expr"]


def test_dashboard_panels_do_not_overlap():
    taken: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_dashboard_has_a_panel_for_each_figure():
    missing = [f for f, names in FIGURES.items() if not any(_shows(f, names, p) for p in _panels())]
    assert not missing, f"figures without a panel: {missing}"


def test_metric_names_are_read_off_promql():
    expr = (
        'histogram_quantile(0.9, sum by (le, model_name) (rate(a_bucket{model_name=~"x|y"}'
        "[$__rate_interval]))) / on (model_name) group_left max(b) or vector(1) and c offset 5m"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}


@pytest.mark.ray
def test_real_metrics_pass_promtool_check_metrics(exercised):
    text = exercised["zmq"]
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count"):
        (sample,) = [
            s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
        ]
        assert sample.value >= 2, f"{name}: the plain and streamed requests were not recorded"
    assert 'request_failed_total{model_name="' in exercised["single"]
    for text in exercised.values():
        _promtool_run("check", "metrics", stdin=text)


@pytest.mark.ray
def test_dashboard_uses_only_exported_names_and_shows_every_family(exercised):
    exported = set().union(*(_sample_names(text) for text in exercised.values()))
    used: set[str] = set()
    for title, expr in _exprs():
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exported, f"{title}: {names - exported} not in /metrics"
        used |= names
    variable = json.loads(DASHBOARD.read_text())["templating"]["list"][1]["definition"]
    assert re.fullmatch(r"label_values\((\w+), model_name\)", variable)[1] in exported
    families = set().union(*(_families(text) for text in exercised.values()))
    shown = {f for f in families if any(n == f or n == f"{f}_bucket" for n in used)}
    assert families - DUPLICATE_FAMILIES - shown == set(), "exported families without a panel"


@pytest.mark.ray
def test_every_dashboard_query_answers_from_a_real_prometheus(observed, exercised, tmp_path):
    servers = observed
    targets = {name: f"127.0.0.1:{s.ports['external_port']}" for name, s in servers.items()}
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    intervals = ("scrape_interval", "scrape_timeout", "evaluation_interval")
    config["global"] = dict.fromkeys(intervals, "1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / "alerts.yml")]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": sorted(targets.values())}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    models = set().union(*(_model_names(text) for text in exercised.values()))
    queries = [(title, _grafana_to_promql(expr, models)) for title, expr in _exprs()]
    with _prometheus(tmp_path / "prometheus.yml", tmp_path) as url, _traffic(servers) as statuses:
        _wait_until(lambda: _targets_up(url), 20, "every coordinator scraped")
        answers: dict[str, list] = {}

        def all_answer() -> bool:
            answers.update({q: _api(url, "query", query=q)["result"] for _, q in queries})
            return all(_has_finite_value(answers[q]) for _, q in queries)

        with contextlib.suppress(TimeoutError):
            _wait_until(all_answer, 45, "every dashboard query answers")
        with contextlib.suppress(TimeoutError):  # evaluated against the real series
            _wait_until(lambda: set(_rules_health(url).values()) == {"ok"}, 10, "rules")
        rules = _rules_health(url)
    empty = [(title, q, answers[q]) for title, q in queries if not _has_finite_value(answers[q])]
    assert not empty, f"queries without data: {empty}"
    assert statuses and set(statuses) == {200}, statuses
    assert len(rules) == 4 and set(rules.values()) == {"ok"}, rules
    kv = next(q for title, q in queries if title == "KV cache usage per worker")
    workers = {(s["metric"]["instance"], s["metric"]["role"]) for s in answers[kv]}
    for name in ("zmq", "grpc"):  # pdserve's worker label is stored as exported_instance
        assert {(targets[name], "prefill"), (targets[name], "decode")} <= workers, workers
    assert all("exported_instance" in s["metric"] for s in answers[kv])


@pytest.mark.ray
def test_a_role_switch_by_the_manage_api_shows_in_instances_and_metrics(observed, exercised):
    server = observed["speculating"]
    url = server.url("manage_port", "/v1/instances/0/role")
    for body, status, error in (
        ({"role": "colocated"}, 400, "role must be one of prefill, decode, got 'colocated'"),
        ({"role": "decode", "wait_s": 61}, 400, "wait_s must be a number in [0, 60], got 61"),
        ({"role": "decode", "extra": 1}, 400, "unknown fields ['extra']"),
        ({"role": "prefill"}, 409, "serves prefill already"),
    ):
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == status and error in response.json()["error"], response.text
    missing = httpx.post(server.url("manage_port", "/v1/instances/9/role"), json={"role": "decode"})
    assert missing.status_code == 404, missing.text
    for role, epoch in (("decode", 1), ("prefill", 2)):  # there and back: left as found
        response = httpx.post(url, json={"role": role, "wait_s": 30}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json() == {"instance": 0, "serving": role, "role_epoch": epoch,
                                   "switching": False}  # fmt: skip
        rows = httpx.get(server.url("manage_port", "/v1/instances")).json()["instances"]
        row = next(r for r in rows if r["role"] == "elastic" and r["instance"] == 0)
        assert (row["serving"], row["role_epoch"], row["switching"]) == (role, epoch, False)
    assert infer(server, PLAIN).status_code == 200  # served in the roles it is back in
    text = _metrics(server)
    assert "worker_role_switches_total{model_name=" in text
    accepted = [
        line
        for line in text.splitlines()
        if line.startswith("worker_role_switches_total{") and 'outcome="accepted"' in line
    ]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in accepted) == 2
    # worker 0's epoch by the role it serves, as of the next load poll
    _wait_until(lambda: 'serving="prefill"} 2.0' in _metrics(server), 10, "worker 0 at epoch 2")
