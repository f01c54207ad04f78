"""What the soak test watches: the RSS of the coordinator and of every worker actor (psutil), and
each worker's figures from the manage port's ``GET /v1/instances``.

A sample is plain JSON: ``t_s`` (seconds since the load began), ``phase`` (``start``, ``load``,
``end``), ``rss_mib`` and ``pids`` per process (``coordinator``, ``prefill/0``, ``decode/0``, ...),
``fds`` per process (open file descriptors; None where another user's process cannot be read),
``workers`` (each worker's figures), ``kv_usage`` per worker, ``in_flight`` (the client's open
requests) and ``by_cause`` (outcomes so far).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

LEAK_FIELDS = ("num_used_blocks", "num_reserved", "num_held", "num_open_streams")
ACTIVITY_FIELDS = ("num_running", "num_waiting")
HEAP_FIELDS = ("heap_in_use_bytes", "heap_free_bytes", "heap_trims")  # workers/heap.py
WORKER_FIELDS = (*ACTIVITY_FIELDS, *LEAK_FIELDS, "num_total_blocks", *HEAP_FIELDS)
MIB = 1024 * 1024


def worker_name(entry: dict[str, Any]) -> str:
    return f"{entry.get('role')}/{entry.get('instance')}"


def listening_pid(url: str) -> int | None:
    """The pid of the local process listening on ``url``'s port (None: none found)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        connections = []
    for conn in connections:
        listens = conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
        if listens and conn.pid is not None:
            return conn.pid
    return None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid).memory_info().rss / MIB
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def num_fds(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return psutil.Process(pid).num_fds()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


async def fetch_instances(client: httpx.AsyncClient, manage_url: str) -> dict[str, Any]:
    """The manage port's ``/v1/instances`` answer."""
    response = await client.get(manage_url + "/v1/instances", timeout=10)
    response.raise_for_status()
    return response.json()


def worker_figures(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker: the figures the soak test follows (None where the worker omits one)."""
    return {
        worker_name(entry): {key: entry.get(key) for key in (*WORKER_FIELDS, "pid")}
        for entry in instances
    }


def kv_usage(figures: dict[str, Any]) -> float | None:
    used, total = figures.get("num_used_blocks"), figures.get("num_total_blocks")
    if used is None or not total:
        return None
    return used / total


class Monitor:
    """Takes samples: on demand (``sample``) or every ``interval_s`` until stopped (``run``)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        manage_url: str,
        coordinator_pid: int | None,
        load_state: Callable[[], tuple[int, dict[str, int]]],
    ) -> None:
        self.client = client
        self.manage_url = manage_url
        self.coordinator_pid = coordinator_pid
        self.load_state = load_state  # () -> (in flight, outcomes by cause)
        self.started = time.monotonic()
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []

    async def sample(self, phase: str) -> dict[str, Any]:
        try:
            workers = worker_figures(
                (await fetch_instances(self.client, self.manage_url))["instances"]
            )
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.errors.append(f"{phase} sample: /v1/instances failed: {type(exc).__name__}: {exc}")
            workers = {}
        pids = {"coordinator": self.coordinator_pid}
        pids |= {name: figures.get("pid") for name, figures in workers.items()}
        in_flight, by_cause = self.load_state()
        sample = {
            "t_s": round(time.monotonic() - self.started, 3),
            "phase": phase,
            "pids": pids,
            "rss_mib": {name: _round(rss_mib(pid)) for name, pid in pids.items()},
            "fds": {name: num_fds(pid) for name, pid in pids.items()},
            "workers": {
                name: {k: v for k, v in f.items() if k != "pid"} for name, f in workers.items()
            },
            "kv_usage": {name: _round(kv_usage(f), 4) for name, f in workers.items()},
            "in_flight": in_flight,
            "by_cause": dict(by_cause),
        }
        self.samples.append(sample)
        return sample

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                await self.sample("load")


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def is_idle(workers: dict[str, dict[str, Any]]) -> bool:
    """Every figure a worker reports of activity and held resources is zero (a figure it omits
    is judged elsewhere and does not keep the wait going)."""
    return all(
        not figures.get(key)
        for figures in workers.values()
        for key in (*ACTIVITY_FIELDS, *LEAK_FIELDS)
    )


async def wait_until_idle(
    client: httpx.AsyncClient, manage_url: str, timeout_s: float, poll_s: float = 0.5
) -> tuple[bool, float]:
    """Poll ``/v1/instances`` until two reads in a row find every worker idle, or ``timeout_s``
    passes; returns (idle, seconds waited)."""
    start = time.monotonic()
    idle_reads = 0
    while time.monotonic() - start < timeout_s:
        try:
            workers = worker_figures((await fetch_instances(client, manage_url))["instances"])
        except (httpx.HTTPError, ValueError, KeyError):
            workers = {"unreachable": {"num_running": 1}}
        idle_reads = idle_reads + 1 if workers and is_idle(workers) else 0
        if idle_reads >= 2:
            return True, round(time.monotonic() - start, 2)
        await asyncio.sleep(poll_s)
    return False, round(time.monotonic() - start, 2)
