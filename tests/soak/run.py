"""Soak test: a bounded mixed load against a running pdserve for a while, then proof that nothing
leaks: no process's RSS keeps growing, and once idle no worker holds a KV block, a reservation,
a held request or an open stream.

    python -m tests.soak.run --minutes 30 --url http://127.0.0.1:1025 \\
        --manage-url http://127.0.0.1:1026 --concurrency 8 [--scratch] [--out PATH]

The load mixes MindIE ``/infer``, OpenAI ``/v1/chat/completions`` and ``/v1/completions``
(streaming and not), TGI ``/generate`` and ``/generate_stream``, with priorities 1-5, client
disconnects, abandoned requests, expiring per-request timeouts and invalid bodies. RSS is read
with psutil (the coordinator by the port it listens on, or ``--coordinator-pid``; the workers by
the pids ``/v1/instances`` lists), so run it on the server's host. Writes the JSON and a PNG next
to it (through ``benchmarks.harness.results``: the run's provenance under ``_meta``; the default
file is under ``benchmarks/results/``, written only from a clean tree), prints a summary; exit
code 0 passed, 1 failed, 2 the server could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx

from benchmarks.harness.results import ResultFile, add_output_arguments
from tests.soak.growth import GrowthBound, GrowthBounds, growth_trends
from tests.soak.judge import (
    RssBounds,
    default_warmup_s,
    heap_trends,
    judge,
    leftovers,
    rss_trends,
)
from tests.soak.load import LoadConfig, Tally, run_load
from tests.soak.monitor import (
    Monitor,
    fetch_instances,
    listening_pid,
    wait_until_idle,
)
from tests.soak.report import per_minute, plot, print_summary
from tests.soak.requests import LoadShape, parse_mix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="load time (fractions too)")
    parser.add_argument("--url", default="http://127.0.0.1:1025", help="the predict port")
    parser.add_argument("--manage-url", help="the manage port (default: the url's host, 1026)")
    parser.add_argument("--concurrency", type=int, default=8, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser, "soak")  # --out (the PNG goes next to it), --scratch
    parser.add_argument("--coordinator-pid", type=int, help="default: who listens on --url")
    parser.add_argument("--api-key", default="", help="sent as Authorization: Bearer")
    parser.add_argument("--mix", default="", help="kind=weight,... (default: every kind)")
    parser.add_argument("--max-tokens", type=int, default=16, help="plain requests: 1..N")
    parser.add_argument("--long-tokens", type=int, default=128, help="requests hit by a fault")
    parser.add_argument("--infer-timeout", type=int, default=1, help="parameters.timeout, s")
    parser.add_argument("--timeout-tokens", type=int, default=512, help="timeout kinds ask this")
    parser.add_argument("--sample-interval", type=float, help="seconds (default 10, or less)")
    parser.add_argument("--warmup-minutes", type=float, help="default: max(1, 20%%), <= 50%%")
    parser.add_argument("--max-rss-slope", type=float, default=2.0, help="MiB/min after warm-up")
    parser.add_argument("--max-rss-growth", type=float, default=64.0, help="MiB after warm-up")
    growth = GrowthBounds()
    per_request = "KiB of RSS per request finished, in 4 of the 5 fifths after warm-up"
    parser.add_argument(
        "--max-rss-per-request",
        type=float,
        default=growth.worker_rss_kib.per_request,
        help=f"workers: {per_request}",
    )
    parser.add_argument(
        "--max-coordinator-rss-per-request",
        type=float,
        default=growth.coordinator_rss_kib.per_request,
        help=f"the coordinator: {per_request}",
    )
    parser.add_argument(
        "--rss-floor", type=float, default=growth.worker_rss_kib.floor, help="KiB a fifth may rise"
    )
    parser.add_argument(
        "--max-fds-per-request",
        type=float,
        default=growth.fds.per_request,
        help="open fds per request finished, in 4 of the 5 fifths after warm-up",
    )
    parser.add_argument(
        "--fds-floor", type=float, default=growth.fds.floor, help="fds a fifth may rise"
    )
    parser.add_argument("--idle-timeout", type=float, default=30.0, help="seconds")
    parser.add_argument("--request-timeout", type=float, default=60.0, help="seconds")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1:
        parser.error("--minutes must be > 0 and --concurrency >= 1")
    try:
        parse_mix(args.mix)
    except ValueError as exc:
        parser.error(str(exc))
    args.url = args.url.rstrip("/")
    if not args.manage_url:
        parsed = urlparse(args.url)
        args.manage_url = f"http://{parsed.hostname}:1026"
    args.manage_url = args.manage_url.rstrip("/")
    return args


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting of the run, with the defaults that depend on its length filled in."""
    duration_s = args.minutes * 60
    warmup_s = (
        args.warmup_minutes * 60
        if args.warmup_minutes is not None
        else default_warmup_s(duration_s)
    )
    interval_s = args.sample_interval or min(10.0, max(1.0, duration_s / 12))
    return {
        "url": args.url,
        "manage_url": args.manage_url,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "mix": parse_mix(args.mix),
        "shape": {
            "max_tokens": args.max_tokens,
            "long_tokens": args.long_tokens,
            "infer_timeout_s": args.infer_timeout,
            "timeout_tokens": args.timeout_tokens,
        },
        "sample_interval_s": interval_s,
        "warmup_s": warmup_s,
        "bounds": {
            "max_rss_slope_mib_per_min": args.max_rss_slope,
            "max_rss_growth_mib": args.max_rss_growth,
            "max_rss_kib_per_request": args.max_rss_per_request,
            "max_coordinator_rss_kib_per_request": args.max_coordinator_rss_per_request,
            "rss_floor_kib": args.rss_floor,
            "max_fds_per_request": args.max_fds_per_request,
            "fds_floor": args.fds_floor,
        },
        "idle_timeout_s": args.idle_timeout,
        "request_timeout_s": args.request_timeout,
    }


@dataclass
class SoakRun:
    monitor: Monitor  # its samples
    tally: Tally  # the outcomes
    load_s: float  # from the first request sent to the last one ended
    idle: bool  # the workers became idle after the load
    idle_wait_s: float


async def soak(
    config: dict[str, Any], client: httpx.AsyncClient, coordinator_pid: int | None
) -> SoakRun:
    """Run the load with the monitor beside it, then wait until the workers are idle."""
    shape = config["shape"]
    load = LoadConfig(
        config["url"],
        config["minutes"] * 60,
        config["concurrency"],
        config["mix"],
        LoadShape(
            shape["max_tokens"],
            shape["long_tokens"],
            timeout_s=shape["infer_timeout_s"],
            timeout_tokens=shape["timeout_tokens"],
        ),
        config["seed"],
        config["request_timeout_s"],
    )
    tally = Tally()
    monitor = Monitor(client, config["manage_url"], coordinator_pid, tally.state)
    await monitor.sample("start")
    stop = asyncio.Event()
    sampler = asyncio.create_task(monitor.run(config["sample_interval_s"], stop))
    started = time.monotonic()
    await run_load(client, load, tally)
    load_s = time.monotonic() - started
    stop.set()
    await sampler
    idle, waited_s = await wait_until_idle(client, config["manage_url"], config["idle_timeout_s"])
    await monitor.sample("end")
    return SoakRun(monitor, tally, round(load_s, 1), idle, waited_s)


def assemble(config: dict[str, Any], run: SoakRun) -> dict[str, Any]:
    """The JSON of the run, verdict included."""
    samples, tally = run.monitor.samples, run.tally
    bounds = RssBounds(
        config["bounds"]["max_rss_slope_mib_per_min"],
        config["bounds"]["max_rss_growth_mib"],
        config["warmup_s"],
    )
    final_workers = samples[-1]["workers"]
    failures = judge(
        samples, bounds, final_workers, run.idle, tally.by_cause, growth_bounds(config["bounds"])
    )
    failures += run.monitor.errors
    return {
        "config": config,
        "coordinator_pid": run.monitor.coordinator_pid,
        "load_s": run.load_s,
        "requests": tally.to_dict(),
        "rss": rss_trends(samples, bounds.warmup_s),
        "growth": growth_trends(samples, bounds.warmup_s),
        "heap": heap_trends(samples, bounds.warmup_s),
        "idle": {"reached": run.idle, "waited_s": run.idle_wait_s, "workers": final_workers},
        "leftovers": leftovers(final_workers),
        "failures": failures,
        "passed": not failures,
        "per_minute": per_minute(samples),
        "samples": samples,
    }


def growth_bounds(bounds: dict[str, float]) -> GrowthBounds:
    """The per-request growth bounds of the run (``soak_growth``)."""
    floor = bounds["rss_floor_kib"]
    return GrowthBounds(
        GrowthBound(bounds["max_coordinator_rss_kib_per_request"], floor),
        GrowthBound(bounds["max_rss_kib_per_request"], floor),
        GrowthBound(bounds["max_fds_per_request"], bounds["fds_floor"]),
    )


async def main_async(args: argparse.Namespace) -> dict[str, Any] | None:
    config = run_config(args)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        try:
            ready = (await fetch_instances(client, config["manage_url"])).get("ready")
        except (httpx.HTTPError, ValueError) as exc:
            print(f"soak: {config['manage_url']}/v1/instances: {exc}", file=sys.stderr)
            return None
        if not ready:
            print(
                "soak: the cluster is not ready (/v1/instances says ready: false)", file=sys.stderr
            )
            return None
        pid = args.coordinator_pid or listening_pid(config["url"])
        if pid is None:
            print(
                "soak: no local process listens on --url; pass --coordinator-pid", file=sys.stderr
            )
        return assemble(config, await soak(config, client, pid))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result_file = ResultFile.start(args, None if argv is None else [sys.argv[0], *argv])
    result = asyncio.run(main_async(args))
    if result is None:
        return 2
    out = result_file.write(result)
    if not args.no_plot:
        plot(result["samples"], result["config"]["warmup_s"], out.with_suffix(".png"))
    print_summary(result)
    print(f"results: {out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
