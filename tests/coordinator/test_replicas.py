"""Coordinator replicas over one shared worker pool (docs/replicas.md), as real processes: a Ray
head, the pool started by ``pdserve workers``, two ``pdserve`` coordinators of the same
``cluster_name``. Both serve; a prefix sent through one is a cache hit through the other; a
coordinator killed with SIGKILL under load costs the other's clients nothing, and its requests
are gone from every worker within the lease bound with no block left in use; coordinators
restarted one after the other under load rejoin, and the workers' pids never change."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from testbed.ray_head import RAY_ENV, RayHead
from tests.support.chaos_load import Load

pytestmark = pytest.mark.ray
CLUSTER = "replicas-test"
LEASE_BOUND_S = 10.0  # a dead coordinator's requests are gone from every worker by then
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # 180 characters


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_model_dir):
    """A Ray head and the shared pool on it; yields (head, config)."""
    head = RayHead()
    backend = {
        "model_path": str(tiny_model_dir),
        "device": "cpu",
        "embedding_model_path": "",
        "cacheBlockSize": 4,
        "kvCacheMemoryMB": 8,
        "cluster_name": CLUSTER,
        "ray_address": f"127.0.0.1:{head.gcs_port}",
    }
    config = {"backend_config": backend}
    path = tmp_path_factory.mktemp("pool") / "ms_coordinator.json"
    path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "coordinator", "workers", "--config", str(path)]
    try:
        started = subprocess.run(command, env=head.env, capture_output=True, text=True, timeout=300)
        assert started.returncode == 0, started.stderr[-3000:]
        workers = json.loads(started.stdout.strip().splitlines()[-1])["workers"]
        assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
        yield head, config
        stopped = subprocess.run([*command, "--stop"], env=head.env, capture_output=True, text=True)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        # the workers, and the response store the coordinators started in the pool
        assert "responses" in json.loads(stopped.stdout.strip().splitlines()[-1])["stopped"]
    finally:
        head.stop()


def _coordinators(tmp_path: Path, config: dict, *names: str) -> list[CoordinatorProcess]:
    """Coordinators started together, once each is ready."""
    servers = []
    for name in names:
        workdir = tmp_path / name
        workdir.mkdir(exist_ok=True)
        servers.append(start_coordinator(workdir, config, env=RAY_ENV))
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.process.kill()
        raise
    return servers


def _coordinator(tmp_path: Path, config: dict, name: str) -> CoordinatorProcess:
    return _coordinators(tmp_path, config, name)[0]


def _instances(server: CoordinatorProcess) -> list[dict]:
    answer = httpx.get(server.url("manage_port", "/v1/instances"), timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()["instances"]


def _pids(server: CoordinatorProcess) -> dict[str, int]:
    return {f"{w['role']}-{w['instance']}": w["pid"] for w in _instances(server)}


def _cached_tokens(server: CoordinatorProcess, prompt: str) -> tuple[int, int]:
    """(prompt tokens, of which cached) of a completion of ``prompt``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(server.url("predict_port", "/v1/completions"), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def _assert_a_response_kept_through_one_goes_on_through_the_other(
    first: CoordinatorProcess, second: CoordinatorProcess
) -> None:
    """The pool's one response store: a response made through either coordinator is read,
    continued and deleted through the other, whole or streamed (kept before its last event)."""

    def responses(server: CoordinatorProcess, path: str = "") -> str:
        return server.url("predict_port", f"/v1/responses{path}")

    body = {"model": _model(first), "input": PROMPT, "max_output_tokens": 4, "temperature": 0}
    made = httpx.post(responses(first), json=body, timeout=60)
    assert made.status_code == 200, made.text
    kept = httpx.get(responses(second, f"/{made.json()['id']}"), timeout=10)
    assert kept.status_code == 200 and kept.json() == made.json()
    follow = {**body, "input": "And then?", "previous_response_id": made.json()["id"]}
    with httpx.stream("POST", responses(second), json={**follow, "stream": True}) as streamed:
        assert streamed.status_code == 200
        last = [line for line in streamed.iter_lines() if line.startswith("data:")][-1]
    went_on = json.loads(last[5:])["response"]
    assert went_on["usage"]["input_tokens"] > made.json()["usage"]["input_tokens"]  # its history
    assert httpx.get(responses(first, f"/{went_on['id']}"), timeout=10).status_code == 200
    assert httpx.delete(responses(first, f"/{made.json()['id']}"), timeout=10).status_code == 200
    assert httpx.get(responses(second, f"/{made.json()['id']}"), timeout=10).status_code == 404


def _model(server: CoordinatorProcess) -> str:
    return httpx.get(server.url("predict_port", "/v1/models"), timeout=10).json()["data"][0]["id"]


class Background:
    """A chaos-suite load on one coordinator, in a thread of its own until ``stop``."""

    def __init__(self, server: CoordinatorProcess, concurrency: int) -> None:
        self.load = Load(server.url("predict_port", ""), _model(server), concurrency)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self.load.run(),), daemon=True
        )
        self._thread.start()

    def stop(self) -> list:
        self._loop.call_soon_threadsafe(self.load.stop.set)
        self._thread.join(timeout=120)
        return self.load.outcomes

    @staticmethod
    def failures(outcomes: list) -> list:
        return [(o.kind, o.status, o.detail) for o in outcomes if o.status != "ok"]


def _wait_idle(server: CoordinatorProcess, timeout_s: float) -> list[dict]:
    """The workers once none holds a request or a block in use (or as they are at the end)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = _instances(server)
        busy = [w for w in workers if w["num_open_streams"] or w["num_used_blocks"]]
        if not busy or time.monotonic() > deadline:
            return workers
        time.sleep(0.2)


def _assert_a_prefix_through_one_is_a_hit_through_the_other(first, second) -> int:
    """A prefix sent through one coordinator is a cache hit through the other; its tokens."""
    num_tokens, cached = _cached_tokens(first, PROMPT)
    assert cached == 0
    time.sleep(1.0)  # a few load polls: the second has the workers' events
    assert _cached_tokens(second, PROMPT + " And then?")[1] >= num_tokens - 4
    return num_tokens


def _assert_killing_one_under_load_costs_the_other_nothing(first, second) -> None:
    """SIGKILL of the first under 16-client load (8 on each): its leases expire within the bound,
    the second's clients see no failure, and every worker goes idle with no block in use."""
    victims, survivors = Background(first, 8), Background(second, 8)
    time.sleep(3.0)
    first.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    first.process.wait(timeout=10)
    expired = 0
    while time.monotonic() - killed_at < LEASE_BOUND_S + 5 and not expired:
        expired = sum(w["num_leases_expired"] for w in _instances(second))
        time.sleep(0.2)
    freed_s = time.monotonic() - killed_at
    assert expired >= 1 and freed_s <= LEASE_BOUND_S, (expired, freed_s)
    time.sleep(2.0)
    outcomes = survivors.stop()
    victims.stop()
    assert outcomes and Background.failures(outcomes) == []
    workers = _wait_idle(second, 30)
    assert all(w["num_open_streams"] == 0 and w["num_used_blocks"] == 0 for w in workers)


def _assert_a_restarted_coordinator_rejoins(tmp_path, config, live, pids, num_tokens) -> None:
    """The killed first coordinator restarted (in ``live[0]``) finds the same workers and cache."""
    live[0] = _coordinator(tmp_path, config, "first-again")
    assert _pids(live[0]) == pids
    assert _cached_tokens(live[0], PROMPT + " Once more.")[1] >= num_tokens - 4


def _assert_a_rolling_restart_fails_nothing(tmp_path, config, live, pids) -> None:
    """A rolling restart under load (the second, then the first; ``live`` kept current) fails no
    request of the coordinator that stays, and never restarts a worker."""
    for name in ("second-again", "first-third"):  # the second, then the first
        first, second = live
        leaving, staying = (second, first) if name.startswith("second") else (first, second)
        load = Background(staying, 8)
        time.sleep(1.0)
        assert leaving.stop() == 0  # drains its own requests
        restarted = _coordinator(tmp_path, config, name)
        time.sleep(1.0)
        assert Background.failures(load.stop()) == []
        assert _pids(restarted) == pids
        live[:] = (first, restarted) if leaving is second else (restarted, second)


def test_two_coordinators_share_the_pool_its_cache_and_survive_each_other(pool, tmp_path):
    head, config = pool
    live = _coordinators(tmp_path, config, "first", "second")  # kept current, stopped at the end
    first, second = live
    try:
        pids = _pids(first)
        assert _pids(second) == pids  # both found the pool `pdserve workers` started
        num_tokens = _assert_a_prefix_through_one_is_a_hit_through_the_other(first, second)
        _assert_a_response_kept_through_one_goes_on_through_the_other(first, second)
        _assert_killing_one_under_load_costs_the_other_nothing(first, second)
        _assert_a_restarted_coordinator_rejoins(tmp_path, config, live, pids, num_tokens)
        _assert_a_rolling_restart_fails_nothing(tmp_path, config, live, pids)
    finally:
        for server in live:
            if server.process.poll() is None:
                server.stop()
