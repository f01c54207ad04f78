"""The soak test (tests/soak/run.py): its verdict on synthetic samples, how it sorts answers by
cause, and a two-minute run against a real pd_separate coordinator (1 prefill + 1 decode) with a
tiny model, on the fixed PD split and on the shipping defaults (local prefill of short prompts,
``stepTargetMs``), soaked side by side, which must pass with nothing left behind."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from testbed.coordinator_process import CoordinatorProcess, start_coordinator
from tests.soak.client import StreamRead, classify_status, classify_stream, read_events
from tests.soak.judge import RssBounds, judge, rss_trends
from tests.soak.report import per_minute
from tests.soak.requests import DEFAULT_MIX, KINDS, LoadShape, draw_plan, parse_mix
from tests.support.coordinator_servers import FIXED_SPLIT

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests.soak.run is found from it
IDLE_WORKER = {
    "num_running": 0,
    "num_waiting": 0,
    "num_used_blocks": 0,
    "num_reserved": 0,
    "num_held": 0,
    "num_open_streams": 0,
    "num_total_blocks": 64,
}
SERVED = {"ok": 10, "unexpected": 0}
BOUNDS = RssBounds(max_slope_mib_per_min=2.0, max_growth_mib=64.0, warmup_s=120.0)


def samples(rss_at, minutes: int = 10, every_s: float = 10.0, pid: int = 7) -> list[dict]:
    """Samples of one process whose RSS at t seconds is ``rss_at(t)``."""
    times = [i * every_s for i in range(int(minutes * 60 / every_s) + 1)]
    return [
        {"t_s": t, "rss_mib": {"decode/0": rss_at(t)}, "pids": {"decode/0": pid}} for t in times
    ]


def test_a_steadily_growing_rss_fails():
    growing = samples(lambda t: 400 + 10 * t / 60)  # 10 MiB/min, 80 MiB after warm-up
    failures = judge(growing, BOUNDS, {"decode/0": IDLE_WORKER}, True, SERVED)
    assert len(failures) == 1 and "RSS of decode/0 grows" in failures[0], failures
    trend = rss_trends(growing, BOUNDS.warmup_s)["decode/0"]
    assert trend["slope_mib_per_min"] == pytest.approx(10.0)
    assert trend["growth_mib"] == pytest.approx(80.0)


def test_a_flat_noisy_rss_passes():
    rng = random.Random(0)
    flat = samples(lambda t: 400 + rng.uniform(-5, 5))
    assert judge(flat, BOUNDS, {"decode/0": IDLE_WORKER}, True, SERVED) == []


def test_growth_within_warm_up_or_below_the_bound_passes():
    warming = samples(lambda t: 300 + min(t, 120))  # grows only during the warm-up
    small = samples(lambda t: 400 + 5 * t / 60)  # 5 MiB/min but only +40 MiB
    for series in (warming, small):
        assert judge(series, BOUNDS, {"decode/0": IDLE_WORKER}, True, SERVED) == []


def test_leftovers_once_idle_fail():
    flat = samples(lambda t: 400)
    leaked = {**IDLE_WORKER, "num_used_blocks": 3, "num_open_streams": 1}
    missing = {k: v for k, v in IDLE_WORKER.items() if k != "num_open_streams"}
    failures = judge(flat, BOUNDS, {"decode/0": leaked, "prefill/0": missing}, True, SERVED)
    assert failures == [
        "decode/0 still has num_used_blocks = 3 once idle",
        "decode/0 still has num_open_streams = 1 once idle",
        "prefill/0 does not report num_open_streams in /v1/instances",
    ]
    busy = {**IDLE_WORKER, "num_running": 2}
    failures = judge(flat, BOUNDS, {"decode/0": busy}, False, SERVED)
    assert "the workers did not become idle after the load stopped" in failures


def test_unexpected_answers_restarts_and_unread_rss_fail():
    flat = samples(lambda t: 400)
    failures = judge(flat, BOUNDS, {"d": IDLE_WORKER}, True, {"ok": 9, "unexpected": 2})
    assert failures == ["2 request(s) ended unexpectedly"]
    restarted = flat[:30] + samples(lambda t: 400, pid=8)[30:]
    assert judge(restarted, BOUNDS, {"d": IDLE_WORKER}, True, SERVED) == [
        "decode/0 restarted during the run: pids [7, 8]"
    ]
    unread = samples(lambda t: None)
    assert (
        "RSS of decode/0 was never read"
        in judge(unread, BOUNDS, {"d": IDLE_WORKER}, True, SERVED)[0]
    )
    assert judge(flat, BOUNDS, {"d": IDLE_WORKER}, True, {"ok": 0}) == ["no request succeeded"]


def test_answers_are_sorted_by_cause():
    rng, shape = random.Random(1), LoadShape()
    plans = {}
    while len(plans) < len(KINDS):
        plan = draw_plan(rng, DEFAULT_MIX, shape)
        plans.setdefault(plan.kind, plan)
    plain, invalid = plans["infer_whole"], plans["invalid_body"]
    timeout, timeout_stream = plans["timeout_infer"], plans["timeout_infer_stream"]
    assert timeout.body["parameters"]["timeout"] == shape.timeout_s
    assert classify_status(plain, 200, "{}").cause == "ok"
    assert classify_status(plain, 500, "boom").cause == "unexpected"
    assert classify_status(plain, 503, "busy").cause == "unexpected"
    assert classify_status(plain, 408, "late").cause == "unexpected"  # no timeout was asked for
    assert classify_status(plain, 429, "busy").cause == "too_many_429"
    assert classify_status(timeout, 408, "late").cause == "timeout_408"
    assert classify_status(invalid, 422, "no").cause == "invalid_4xx"
    assert classify_status(invalid, 200, "{}").cause == "unexpected"
    assert classify_status(invalid, 500, "boom").cause == "unexpected"
    stream = plans["infer_stream"]
    assert classify_stream(stream, StreamRead(events=3, finished=True)).cause == "ok"
    assert classify_stream(stream, StreamRead(events=3)).cause == "unexpected"  # cut short
    error = StreamRead(events=2, error="Request inference timeout")
    assert classify_stream(stream, error).cause == "unexpected"
    assert classify_stream(timeout_stream, error).cause == "timeout_408"
    closed = StreamRead(events=1, closed_early=True)
    assert classify_stream(plans["disconnect_stream"], closed).cause == "client_aborted"


def test_stream_events_split_only_at_line_feeds():
    """Token text may hold U+2028 or U+0085 unescaped; the event is still one line."""
    body = 'data: {"token": {"text": "a\u2028b\x85"}}\n\ndata: {"generated_text": "x"}\n\n'
    read = StreamRead()
    asyncio.run(read_events(httpx.Response(200, content=body.encode()), read, None))
    assert (read.events, read.finished, read.error) == (2, True, None)


def test_the_mix_is_seeded_and_parsed():
    draw = lambda seed: [draw_plan(random.Random(seed), DEFAULT_MIX, LoadShape()) for _ in range(5)]  # noqa: E731
    assert draw(3) == draw(3)
    assert parse_mix("infer_stream=2,invalid_body=1") == {"infer_stream": 2.0, "invalid_body": 1.0}
    with pytest.raises(ValueError, match="kind=weight"):
        parse_mix("nonsense=1")


def test_outcomes_are_folded_into_minutes():
    def sample(t_s: float, ok: int, rss: float) -> dict:
        return {
            "t_s": t_s,
            "rss_mib": {"coordinator": rss},
            "kv_usage": {"decode/0": 0.1},
            "in_flight": 3,
            "by_cause": {"ok": ok},
        }

    rows = per_minute([sample(0, 0, 100), sample(30, 5, 120), sample(70, 12, 110)])
    assert [(r["minute"], r["requests"], r["rss_mib_max"]["coordinator"]) for r in rows] == [
        (0, 5, 120),
        (1, 7, 110),
    ]


def soak_config(model_dir: Path, split: dict) -> dict:
    return {
        "backend_config": {
            "model_path": str(model_dir),
            "embedding_model_path": "",
            "device": "cpu",
            "cacheBlockSize": 4,
            "kvCacheMemoryMB": 4,
            "maxIterTimes": 512,
            "num_prefill_instances": 1,
            "num_decode_instances": 1,
            **split,
        },
        "digs_scheduler_config": {"deploy_mode": "pd_separate"},
    }


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory, tiny_model_dir) -> Iterator[dict[str, CoordinatorProcess]]:
    """Two coordinators at once, soaked side by side (half the wall time of one after the
    other; each soak is bounded by time, not by a count of requests)."""
    servers: dict[str, CoordinatorProcess] = {}
    try:
        for name, split in (("fixed-split", FIXED_SPLIT), ("defaults", {})):
            workdir = tmp_path_factory.mktemp(f"soak-{name}")
            servers[name] = start_coordinator(workdir, soak_config(tiny_model_dir, split))
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            try:
                server.stop()
            except subprocess.TimeoutExpired:
                server.process.kill()


def run_soaks(
    servers: dict[str, CoordinatorProcess], out_dir: Path, *args: str
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """``tests.soak.run`` against every server at once: each one's run and result file."""
    started = {}
    for name, server in servers.items():
        out = out_dir / f"soak-{name}.json"
        command = [sys.executable, "-m", "tests.soak.run", "--url", server.url("predict_port", "")]
        command += ["--manage-url", server.url("manage_port", ""), "--out", str(out), *args]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        started[name] = (command, process, out)
    runs = {}
    for name, (command, process, out) in started.items():
        try:
            stdout, stderr = process.communicate(timeout=300)
        finally:
            process.kill()
        runs[name] = (subprocess.CompletedProcess(command, process.returncode, stdout, stderr), out)
    return runs


@pytest.mark.ray
def test_two_minute_soaks_pass_and_leave_nothing_behind(pd_servers, tmp_path):
    """On the fixed PD split and on the shipping defaults. Long enough for the growth gate to
    see past the steep first minute (the default warm-up) and fit each fifth of the second
    through 13 samples, one a second."""
    args = ("--minutes", "2", "--concurrency", "6", "--sample-interval", "1")
    for name, (run, out) in run_soaks(pd_servers, tmp_path, *args).items():
        assert run.returncode == 0, (name, run.stdout + run.stderr)
        check_a_passed_soak(json.loads(out.read_text()), pd_servers[name], out)


def check_a_passed_soak(result: dict, server: CoordinatorProcess, out: Path) -> None:
    assert set(result) >= {"config", "requests", "rss", "samples", "per_minute", "leftovers"}
    assert result["passed"] and result["failures"] == []
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["coordinator_pid"] == server.process.pid  # found by its port
    assert set(result["rss"]) == {"coordinator", "prefill/0", "decode/0"}
    for trend in result["rss"].values():
        assert trend["num_points"] >= 2 and trend["slope_mib_per_min"] is not None
    assert set(result["growth"]) == set(result["rss"])
    for name, figures in result["growth"].items():  # RSS and open fds, every process
        assert set(figures) == {"rss_mib", "fds"}, name
        assert all(len(f["segments"]) == 5 for f in figures.values()), (name, figures)
    assert set(result["heap"]) == {"prefill/0", "decode/0"}  # workers report their C heap
    for heap in result["heap"].values():
        assert heap["in_use_last_mib"] > 0 and heap["in_use_slope_mib_per_min"] is not None
    requests = result["requests"]
    assert requests["by_cause"]["unexpected"] == 0, requests["unexpected_examples"]
    for cause in ("ok", "invalid_4xx", "client_aborted"):
        assert requests["by_cause"][cause] > 0, requests["by_cause"]
    assert set(requests["by_kind"]) == set(KINDS)
    assert result["idle"]["reached"] and result["leftovers"] == {}
    assert {s["phase"] for s in result["samples"]} == {"start", "load", "end"}
    assert sum(row["requests"] for row in result["per_minute"]) == requests["total"]


@pytest.mark.ray
def test_a_soak_beyond_its_bounds_exits_1(pd_servers, tmp_path):
    bounds = ("--max-rss-slope=-1e6", "--max-rss-growth=-1e6", "--no-plot")
    growth = ("--max-rss-per-request=-1e6", "--max-coordinator-rss-per-request=-1e6")
    growth += ("--rss-floor=-1e6", "--sample-interval", "0.5")
    args = ("--minutes", "0.1", "--warmup-minutes", "0", *bounds, *growth)
    for name, (run, out) in run_soaks(pd_servers, tmp_path, *args).items():
        assert run.returncode == 1, (name, run.stdout + run.stderr)
        assert "FAIL: RSS of coordinator grows" in run.stdout
        assert "FAIL: coordinator leaks KiB of RSS per request" in run.stdout
        assert "FAIL: decode/0 leaks KiB of RSS per request" in run.stdout
        assert json.loads(out.read_text())["passed"] is False
