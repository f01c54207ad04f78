"""The dashboard and the metric names a coordinator exposes: what the observability tests share."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from testbed.coordinator_process import CoordinatorProcess, free_port
from tests.support.coordinator_servers import infer
from tests.support.prerequisites import require

ROOT = Path(__file__).resolve().parents[2]


DASHBOARD = ROOT / "deploy" / "helm" / "pdserve" / "dashboards" / "pdserve.json"


PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"


PLAIN = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 6}}


STREAMED = {"inputs": "A paged KV cache", "stream": True, "parameters": {"max_new_tokens": 6}}


# a constrained request (TGI's grammar): the structured-output panels' series
CONSTRAINED = {
    "inputs": "A code",
    "parameters": {"max_new_tokens": 6, "grammar": {"type": "regex", "value": "[0-9]{2}-[a-z]{2}"}},
}


# a prompt whose words repeat, to the coordinator that speculates: the n-gram drafter finds a
# match in it at once, and a request that stopped drafting (the tiny model accepts little) tries
# again every few steps of its 32, so checks (the speculative_* series) come with every request
REPEATING = {
    "inputs": "red blue red blue red blue red blue red",
    "parameters": {"max_new_tokens": 32, "ignore_eos": True},
}


RATE_WINDOW = "10s"  # stands for Grafana's $__rate_interval etc. under 1 s scraping


# Each figure the dashboard must show: the series one panel must query together.
FIGURES = {
    "request rate by outcome": (
        "request_received_total",
        "request_success_total",
        "request_failed_total",
    ),
    "TTFT percentiles": ("time_to_first_token_seconds_bucket",),
    "TPOT percentiles": ("time_per_output_token_seconds_bucket",),
    "end-to-end latency percentiles": ("e2e_request_latency_seconds_bucket",),
    "tokens/s in and out": ("prompt_tokens_total", "generation_tokens_total"),
    "waiting and running requests": ("num_requests_waiting", "num_requests_running"),
    "KV cache usage per worker and role": ("kv_cache_usage_perc",),
    "per-instance queue depth": ("worker_num_requests_waiting",),
    "per-instance batch size": ("worker_num_requests_running",),
    "constrained requests by kind": ("constrained_requests_total",),
    "constraint compiles": ("grammar_compile_seconds_bucket", "grammar_cache_hits_total"),
    "grammar masking per worker": ("grammar_mask_seconds_total", "grammar_masked_rows_total"),
    "speculative acceptance": (
        "speculative_accepted_tokens_total",
        "speculative_drafted_tokens_total",
    ),
    "tokens per speculative check": (
        "speculative_accepted_tokens_total",
        "speculative_checks_total",
    ),
    "speculative acceptance histogram": ("speculative_checks_by_accepted_total",),
    "KV tier contents": ("kv_tier_bytes", "kv_tier_capacity_bytes", "kv_tier_blocks"),
    "worker roles and epochs": ("worker_role_epoch",),
    "role switches": ("worker_role_switches_total", "request_role_switch_migrations_total"),
    "KV tier traffic": (
        "kv_tier_demotions_total",
        "kv_tier_stored_total",
        "kv_tier_hits_total",
        "kv_tier_promotions_total",
        "kv_tier_evicted_total",
    ),
    "KV tier faults": (
        "kv_tier_corrupt_total",
        "kv_tier_failed_writes_total",
        "kv_tier_demotions_skipped_total",
        "kv_tier_load_seconds_total",
    ),
}


QUANTILE_FIGURES = ("TTFT percentiles", "TPOT percentiles", "end-to-end latency percentiles")


WORKER_FIGURES = (
    "KV cache usage per worker and role",
    "per-instance queue depth",
    "per-instance batch size",
    "speculative acceptance",
    "tokens per speculative check",
    "KV tier contents",
    "KV tier traffic",
    "KV tier faults",
)


DUPLICATE_FAMILIES = {"npu_cache_usage_perc"}  # MindIE's name for kv_cache_usage_perc


NOT_METRICS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}


def _binary(name: str) -> str:
    """promtool or prometheus; without Debian's prometheus a skip locally, a failure in CI."""
    require(shutil.which("prometheus"), "prometheus (Debian's package; .ci/run installs it)")
    path = shutil.which(name)
    assert path, f"prometheus is installed but {name} is not on PATH"
    return path


def _promtool_run(*args: str, stdin: str | None = None) -> None:
    result = subprocess.run(
        [_binary("promtool"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=PROMETHEUS_DIR,
    )
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def _panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def _exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)\s*(\()?", expr)
    return {m[1] for m in found if not m[2] and m[1].lower() not in NOT_METRICS}


def _shows(figure: str, names: tuple[str, ...], panel: dict) -> bool:
    """Whether the panel shows the figure: its series together, counters and buckets as rates,
    latencies as p50/p90/p99, worker figures by role and instance."""
    exprs = [t["expr"] for t in panel["targets"]]
    if not set(names) <= set().union(*map(metric_names, exprs)):
        return False
    counters = [n for n in names if n.endswith(("_total", "_bucket"))]
    if not all(any(f"rate({n}{{" in e for e in exprs) for n in counters):
        return False
    if figure in QUANTILE_FIGURES:
        found = [re.match(r"histogram_quantile\((0\.\d+),", e) for e in exprs if names[0] in e]
        if sorted(m[1] for m in found if m) != ["0.5", "0.9", "0.99"]:
            return False
    grouped = r"by \([^)]*\brole\b[^)]*\binstance\b[^)]*\)"
    return figure not in WORKER_FIGURES or all(re.search(grouped, e) for e in exprs)


def _sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _families(text: str) -> set[str]:
    """The metric families of an exposition, less the *_created timestamps of prometheus_client."""
    names = re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE)
    return {name for name in names if not name.endswith("_created")}


def _model_names(text: str) -> set[str]:
    return {
        s.labels["model_name"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if "model_name" in s.labels
    }


def _with_regex(body: dict, regex: str) -> dict:
    grammar = {"type": "regex", "value": regex}
    return {**body, "parameters": {**body["parameters"], "grammar": grammar}}


def _send(server: CoordinatorProcess, body: dict) -> httpx.Response:
    """``body`` to MindIE's /infer, or (a grammar in it) to TGI's /generate."""
    if "grammar" not in body["parameters"]:
        return infer(server, body)
    with server.client() as client:
        return client.post(server.url("predict_port", "/generate"), json=body)


def _metrics(server: CoordinatorProcess) -> str:
    response = httpx.get(server.url("external_port", "/metrics"), timeout=10)
    assert response.status_code == 200
    return response.text


def _received(server: CoordinatorProcess) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(_metrics(server))
        for s in f.samples
        if s.name == "request_received_total"
    )


def _wait_until(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not in {timeout_s} s: {what}")
        time.sleep(0.05)


def _overload(server: CoordinatorProcess) -> None:
    """A fourth request while max_requests (3) are in flight: a real request_failed_total."""
    long = {"inputs": "hello", "parameters": {"max_new_tokens": 200}}
    before = _received(server)
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(infer, server, long) for _ in range(3)]
        _wait_until(lambda: _received(server) >= before + 3, 30, "three requests in flight")
        refused = infer(server, {"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert [f.result().status_code for f in held] == [200, 200, 200]
    assert refused.status_code == 429, refused.text


@contextlib.contextmanager
def _traffic(servers: dict[str, CoordinatorProcess]) -> Iterator[list[int | str]]:
    """Requests to zmq and grpc (and to the speculating server, if there) without pause, so that
    every rate() window sees some."""
    stop, statuses = threading.Event(), []
    sent = (PLAIN, STREAMED, CONSTRAINED)
    pairs = [(servers[n], b) for b in sent for n in ("zmq", "grpc")]
    if "speculating" in servers:
        pairs += [(servers["speculating"], REPEATING)] * 2
    bodies = itertools.cycle(pairs)
    specs = itertools.count()

    def send() -> None:
        while not stop.is_set():
            server, body = next(bodies)
            if body is CONSTRAINED:  # a new spec now and then: compiled at the door, timed
                body = _with_regex(body, f"[0-9]{{2}}-x{next(specs) // 2 % 64}")
            try:
                statuses.append(_send(server, body).status_code)
            except httpx.HTTPError as exc:
                statuses.append(repr(exc))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield statuses
    finally:
        stop.set()
        thread.join(timeout=60)


@contextlib.contextmanager
def _prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """A real Prometheus on loopback; its base URL."""
    binary, port = _binary("prometheus"), free_port()
    with open(workdir / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until(lambda: _answers(f"{url}/-/ready", process, workdir), 30, "prometheus ready")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str, process: subprocess.Popen, workdir: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()}")
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _api(url: str, path: str, **params: str) -> dict:
    body = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]


def _grafana_to_promql(expr: str, models: set[str]) -> str:
    pattern = "|".join(re.escape(m) for m in sorted(models)).replace("\\", "\\\\")
    expr = re.sub(r"\$\{model_name(?::\w+)?\}|\$model_name\b", lambda _: pattern, expr)
    expr = re.sub(r"\$\{coordinator(?::\w+)?\}|\$coordinator\b", ".*", expr)  # All
    return re.sub(r"\$\{__\w+\}|\$__\w+", RATE_WINDOW, expr)


def _targets_up(url: str) -> bool:
    return {t["health"] for t in _api(url, "targets")["activeTargets"]} == {"up"}


def _rules_health(url: str) -> dict[str, str]:
    return {r["name"]: r["health"] for g in _api(url, "rules")["groups"] for r in g["rules"]}


def _has_finite_value(result: list[dict]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)
