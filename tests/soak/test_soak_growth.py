"""The soak test's growth gates on synthetic samples shaped like the CI soak's: one a second for two
minutes, the second one after the warm-up, 25 requests finished a second, and processes whose RSS
rises as healthy ones do there: a worker's by 40 MiB in its first half-minute, then creeping ever
slower (from about 6 KiB per request at one minute to 4 at two), the coordinator's by about 1 KiB
per request. A realistic leak on top of that trips the gate; what a healthy run does (the creep,
a one-off jump after warm-up, jitter, connections opening and closing) does not."""

from __future__ import annotations

import math
import random

import pytest

from tests.soak.judge import RssBounds, judge, rss_failures, rss_trends

RATE = 25.0  # requests finished per second
SECONDS = 120
WARMUP_S = 60.0
BOUNDS = RssBounds(warmup_s=WARMUP_S)  # the time-based bounds, as the CI soak runs them
IDLE = {
    "num_running": 0,
    "num_waiting": 0,
    "num_used_blocks": 0,
    "num_reserved": 0,
    "num_held": 0,
    "num_open_streams": 0,
}
SERVED = {"ok": int(SECONDS * RATE), "unexpected": 0}


def samples(rss_at, fds_at=lambda t, n: 40, name: str = "decode/0") -> list[dict]:
    """One sample a second of process ``name``, whose RSS (MiB) and open fds at ``t`` seconds,
    ``n`` requests finished, are ``rss_at(t, n)`` and ``fds_at(t, n)``."""
    rows = []
    for t in range(SECONDS + 1):
        n = int(t * RATE)
        rows.append(
            {
                "t_s": float(t),
                "rss_mib": {name: rss_at(t, n)},
                "fds": {name: fds_at(t, n)},
                "pids": {name: 7},
                "by_cause": {"ok": n},
            }
        )
    return rows


def healthy(t: float) -> float:
    """A healthy worker's RSS (MiB): a steep warm-up, then a slowing creep."""
    return 395 + 40 * (1 - math.exp(-t / 10)) + 14 * math.log(1 + t / 30)


def healthy_coordinator(n: int, kib_per_request: float = 1.0) -> float:
    return 410 + kib_per_request * n / 1024


def jitter(seed: int, mib: float = 0.3):
    rng = random.Random(seed)
    return lambda: rng.uniform(-mib, mib)


def failures(rows: list[dict], workers: dict | None = None) -> list[str]:
    return judge(rows, BOUNDS, workers or {"decode/0": IDLE}, True, SERVED)


@pytest.mark.parametrize("kib_per_request", [5, 8, 32])
def test_a_worker_leaking_a_few_kib_per_request_trips_the_gate(kib_per_request):
    noise = jitter(kib_per_request)
    rows = samples(lambda t, n: healthy(t) + kib_per_request * n / 1024 + noise())
    found = failures(rows)
    assert len(found) == 1 and found[0].startswith("decode/0 leaks KiB of RSS per request"), found
    if kib_per_request <= 8:  # the time-based gate alone lets it through in a CI soak
        assert rss_failures(rss_trends(rows, WARMUP_S), BOUNDS) == []


@pytest.mark.parametrize("kib_per_request", [2.5, 4])
def test_a_coordinator_leaking_a_few_kib_per_request_trips_the_gate(kib_per_request):
    noise = jitter(int(kib_per_request), mib=0.1)
    leaking = lambda t, n: healthy_coordinator(n) + kib_per_request * n / 1024 + noise()  # noqa: E731
    found = failures(samples(leaking, name="coordinator"))
    assert len(found) == 1 and found[0].startswith("coordinator leaks KiB of RSS"), found


@pytest.mark.parametrize("jump_at_s", [61, 75, 90, 105, 119])
def test_a_jump_after_warm_up_then_flat_passes(jump_at_s):
    noise = jitter(jump_at_s)
    rows = samples(lambda t, n: healthy(t) + (24 if t >= jump_at_s else 0) + noise())
    assert failures(rows) == []


def test_the_healthy_creep_and_jitter_pass():
    noise = jitter(1, mib=1.0)
    assert failures(samples(lambda t, n: healthy(t) + noise())) == []
    creeping = lambda t, n: healthy_coordinator(n, 1.5) + noise() / 10  # noqa: E731
    assert failures(samples(creeping, name="coordinator")) == []


def test_a_leaked_fd_every_hundred_requests_trips_the_gate():
    rows = samples(lambda t, n: 340.0, lambda t, n: 40 + n // 100)
    found = failures(rows)
    assert len(found) == 1 and found[0].startswith("decode/0 leaks open fds per request"), found


def test_connections_opening_and_closing_pass():
    rng = random.Random(2)
    rows = samples(lambda t, n: 340.0, lambda t, n: 40 + rng.randrange(0, 12))
    assert failures(rows) == []


def test_a_leaked_kv_block_per_request_fails_once_idle():
    leaked = {**IDLE, "num_used_blocks": 37}
    rows = samples(lambda t, n: 340.0)
    assert failures(rows, {"decode/0": leaked}) == [
        "decode/0 still has num_used_blocks = 37 once idle"
    ]


def test_too_few_samples_after_warm_up_fail():
    rows = [r for r in samples(lambda t, n: 340.0) if r["t_s"] < WARMUP_S or r["t_s"] % 7 == 0]
    assert failures(rows) == [
        "decode/0: 9 sample(s) of its KiB of RSS after warm-up, the growth gate needs 11",
        "decode/0: 9 sample(s) of its open fds after warm-up, the growth gate needs 11",
    ]
