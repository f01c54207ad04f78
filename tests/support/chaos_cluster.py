"""What the chaos suite reads off a coordinator process: its workers on ``/v1/instances``, its
counters on ``/metrics``, and when it is idle again."""

from __future__ import annotations

import asyncio
import time

import httpx

from testbed.coordinator_process import CoordinatorProcess

IDLE_FIELDS = ("num_used_blocks", "num_reserved", "num_held", "num_open_streams", "num_running")


def instances(server: CoordinatorProcess) -> list[dict]:
    response = httpx.get(server.url("manage_port", "/v1/instances"), timeout=10)
    return response.json()["instances"]


def pid(server: CoordinatorProcess, role: str) -> int:
    (instance,) = [i for i in instances(server) if i["role"] == role]
    return instance["pid"]


def counter(server: CoordinatorProcess, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples (those whose labels hold ``label``, if given)."""
    text = httpx.get(server.url("external_port", "/metrics"), timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and label in line.split("}", 1)[0]
    )


def migrations(server: CoordinatorProcess) -> float:
    return counter(server, "request_migrations_total")


def failed_by_reason(server: CoordinatorProcess) -> dict[str, float]:
    """Requests failed so far, by ``request_failed_total``'s reason (``error``: every migration
    spent)."""
    text = httpx.get(server.url("external_port", "/metrics"), timeout=10).text
    failed: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("request_failed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            failed[reason] = failed.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return failed


def prefills_by_role(server: CoordinatorProcess) -> dict[str, float]:
    """Prompts computed so far by the prefill worker (handed off) and by the decode worker
    itself (prefilled locally)."""
    name = "request_prefill_time_seconds_count"
    return {role: counter(server, name, f'role="{role}"') for role in ("prefill", "decode")}


def model(server: CoordinatorProcess) -> str:
    return httpx.get(server.url("predict_port", "/v1/models")).json()["data"][0]["id"]


async def until_idle(server: CoordinatorProcess, timeout_s: float = 30) -> list[dict]:
    """Both workers answering, neither holding anything; AssertionError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = await asyncio.to_thread(instances, server)
        busy = [i for i in listed if any(i.get(f, 1) != 0 for f in IDLE_FIELDS)]
        answering = [i for i in listed if i.get("status") == "answering"]
        if len(answering) == 2 and not busy:
            return listed
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {timeout_s} s after the load: {listed}")
        await asyncio.sleep(0.5)
