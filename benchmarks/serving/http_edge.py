"""What the HTTP edge's defences cost on the normal path, and what they buy under attack, side by
side in one run: uvicorn's plain httptools protocol (the edge before), the guarded one
(:mod:`coordinator.http_edge`) and h11 with its incomplete-event limit (the other choice).

Each protocol serves the real predict app over a scripted service that streams tokens as fast
as it can (so the edge, not a model, is what is timed), in a child process of its own pinned
to one core; this process is the client, on the other.

- **Normal path**: 1 and 64 concurrent ``/v1/completions`` streams of ``--tokens`` events each:
  the server's CPU time per event (the figure: the client, in Python, may be the slower side)
  and events per second, the protocols in turn for ``--rounds`` rounds (median, min-max), each
  round's ratio to plain httptools.
- **Attack**: a 32 MiB header in 64 KiB writes (time until the server refuses or takes it,
  and the server's RSS growth); 64 connections that never finish their headers (how many the
  server still holds after ``header_timeout`` + 2 s); the probe's latency while four clients
  write 8 MiB headers in 1 KiB writes (the probes on the predict loop, as before, for the
  plain protocols; on their own thread for the guarded one).

``python -m benchmarks.serving.http_edge`` writes ``benchmarks/results/http_edge.json``
(``--scratch``: a trial run outside it; ``--protocols``, ``--requests-scale`` and
``--no-attacks`` make a short one). A stream that fails is counted, with examples of its error
(``failed_streams``), and none of its events count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from typing import Any

import httpx
import psutil

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.stats import percentile, spread

PROTOCOLS = ("httptools", "guarded", "h11")
HEADER_TIMEOUT_S = 5.0
MIB = 1024 * 1024


def serve(protocol: str, port: int, tokens: int) -> None:
    """The child: the predict app on ``port`` behind ``protocol``, a probe on ``port + 1``."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import Response

    from coordinator.connection_caps import ConnectionCaps
    from coordinator.http_edge import EdgeLimits, uvicorn_limits
    from coordinator.threaded_server import ThreadedServer
    from tests.support.door_fakes import ScriptedService, predict_app

    os.sched_setaffinity(0, {0})
    options: dict[str, Any] = {"http": protocol}
    probe_options = options
    if protocol == "guarded":
        limits = EdgeLimits(header_timeout_s=HEADER_TIMEOUT_S)
        options = uvicorn_limits(limits, ConnectionCaps(10000 + 64))
        probe_options = uvicorn_limits(limits)
    elif protocol == "h11":
        options["h11_max_incomplete_event_size"] = 64 * 1024
    service = ScriptedService(tokens)
    service.max_requests = 10000
    probes = FastAPI()
    probes.add_api_route("/v1/health", lambda: Response(), methods=["GET"])
    common: dict[str, Any] = {"host": "127.0.0.1", "log_level": "error"}
    predict = uvicorn.Server(uvicorn.Config(predict_app(service), port=port, **common, **options))
    probe = uvicorn.Server(uvicorn.Config(probes, port=port + 1, **common, **probe_options))
    if protocol == "guarded":
        ThreadedServer(probe, "probes").start()
        predict.run()
    else:

        async def both() -> None:
            await asyncio.gather(predict.serve(), probe.serve())

        asyncio.run(both())


@contextlib.contextmanager
def server(protocol: str, tokens: int):
    port = free_port_pair()
    child = multiprocessing.get_context("spawn").Process(
        target=serve, args=(protocol, port, tokens), daemon=True
    )
    child.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, f"{protocol} did not start"
            time.sleep(0.1)
    try:
        yield port, psutil.Process(child.pid)
    finally:
        child.terminate()
        child.join(10)


def free_port_pair() -> int:
    """A port free with the one after it."""
    while True:
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with contextlib.suppress(OSError):
                second.bind(("127.0.0.1", port + 1))
                return port


async def streams(
    port: int, process: psutil.Process, concurrency: int, requests: int, errors: list[str]
) -> tuple[float, float]:
    """Events per second over ``requests`` streams, ``concurrency`` at a time, and the
    server's CPU microseconds per event (what the protocol costs, whatever the client's speed).
    A stream that fails is appended to ``errors``."""
    limits = httpx.Limits(max_connections=concurrency)
    body = {"prompt": "hi", "stream": True, "max_tokens": 1000}
    events = 0

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal events
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    errors.append(f"HTTP {response.status_code}")
                    return
                async for line in response.aiter_lines():
                    events += line.startswith("data: {")
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60
    ) as client:
        await asyncio.gather(*(one(client) for _ in range(min(concurrency, 8))))  # warm-up
        events = 0
        cpu, start = sum(process.cpu_times()[:2]), time.perf_counter()
        for _ in range(requests // concurrency):
            await asyncio.gather(*(one(client) for _ in range(concurrency)))
        elapsed, used = time.perf_counter() - start, sum(process.cpu_times()[:2]) - cpu
        return events / elapsed, 1e6 * used / max(events, 1)


def huge_header(port: int, process: psutil.Process) -> dict[str, Any]:
    before = process.memory_info().rss
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent, start, chunk = 0, time.perf_counter(), b"a" * 65536
    with contextlib.suppress(OSError):
        while sent < 32 * MIB:
            sock.sendall(chunk)
            sent += len(chunk)
        sock.sendall(b"\r\n\r\n")
    with contextlib.suppress(OSError):
        status = sock.recv(64).split(b" ")[1].decode()
    elapsed = time.perf_counter() - start
    grown = process.memory_info().rss - before
    sock.close()
    return {
        "status": locals().get("status", "closed"),
        "bytes_sent": sent,
        "seconds": round(elapsed, 3),
        "rss_growth_mib": round(grown / MIB, 1),
    }


def half_sent(port: int, process: psutil.Process) -> dict[str, Any]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(64)]
    for sock in socks:
        sock.sendall(b"POST /infer HTTP/1.1\r\nhost: x\r\n")
    time.sleep(HEADER_TIMEOUT_S + 2)
    held = sum(
        1
        for c in process.net_connections("tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
    )
    for sock in socks:
        sock.close()
    return {"connections": 64, f"held_after_{HEADER_TIMEOUT_S + 2:g}_s": held}


def probe_under_attack(port: int) -> dict[str, Any]:
    """The probe's latency (ms) while four clients write 8 MiB headers in 1 KiB writes."""

    def attack() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
            with contextlib.suppress(OSError):
                for _ in range(8 * 1024):
                    sock.sendall(b"a" * 1024)

    attackers = [threading.Thread(target=attack) for _ in range(4)]
    for thread in attackers:
        thread.start()
    latencies = []
    with httpx.Client(timeout=30) as client:
        while len(latencies) < 400 and (
            len(latencies) < 20 or any(thread.is_alive() for thread in attackers)
        ):
            start = time.perf_counter()
            client.get(f"http://127.0.0.1:{port + 1}/v1/health")
            latencies.append(1000 * (time.perf_counter() - start))
            time.sleep(0.02)
    for thread in attackers:
        thread.join()
    return {
        "probes": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 1),
        "p99_ms": round(percentile(latencies, 99), 1),
        "max_ms": round(max(latencies), 1),
    }


def _parser() -> argparse.ArgumentParser:
    """The command line of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="of " + ", ".join(PROTOCOLS)
    )
    parser.add_argument(
        "--requests-scale", type=float, default=1.0, help="times the streams of a round (48, 384)"
    )
    parser.add_argument("--no-attacks", action="store_true", help="the normal path only")
    add_output_arguments(parser, "http_edge")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # before the pinning below: the machine's cores, not this process's
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    protocols = [p for p in args.protocols.split(",") if p]
    if "httptools" not in protocols or not set(protocols) <= set(PROTOCOLS):
        parser.error(f"--protocols: of {', '.join(PROTOCOLS)}, httptools among them (the base)")
    loads = [(1, max(1, round(48 * args.requests_scale)))]
    loads.append((64, 64 * max(1, round(6 * args.requests_scale))))
    os.sched_setaffinity(0, {1} if os.cpu_count() and os.cpu_count() > 1 else {0})
    rates, costs, errors, attacks = _measure(args, protocols, loads, result_file)
    result = {
        # the report reads ``meta``; the result file keeps its provenance under ``_meta`` too
        "meta": result_file.meta,
        "tokens_per_stream": args.tokens,
        "streams_per_round": {str(c): n for c, n in loads},
        "events_per_s": {p: {str(c): spread(v, 1) for c, v in r.items()} for p, r in rates.items()},
        "server_cpu_us_per_event": {
            p: {str(c): spread(v, 2) for c, v in r.items()} for p, r in costs.items()
        },
        # server CPU per event, each round against httptools' own
        "cpu_ratio_to_httptools": _cpu_ratios(costs, protocols),
        "attacks": attacks,
    }
    failed = {p: {"count": len(e), "examples": sorted(set(e))[:5]} for p, e in errors.items() if e}
    if failed:
        result["failed_streams"] = failed
    result_file.write(result)
    print(json.dumps({k: result[k] for k in ("cpu_ratio_to_httptools", "attacks")}, indent=1))
    return 0


def _measure(
    args: argparse.Namespace,
    protocols: list[str],
    loads: list[tuple[int, int]],
    result_file: ResultFile,
) -> tuple[dict, dict, dict[str, list[str]], dict[str, Any]]:
    """Every protocol in turn, each round, on a server of its own: its event rates and server
    CPU per event at each load, its failed streams, and (first round) the attacks."""
    rates: dict[str, dict[int, list[float]]] = {p: {1: [], 64: []} for p in protocols}
    costs: dict[str, dict[int, list[float]]] = {p: {1: [], 64: []} for p in protocols}
    errors: dict[str, list[str]] = {p: [] for p in protocols}
    attacks: dict[str, Any] = {}
    for round_index in range(args.rounds):
        for protocol in protocols:
            with server(protocol, args.tokens) as (port, process):
                for concurrency, requests in loads:
                    rate, cost = asyncio.run(
                        streams(port, process, concurrency, requests, errors[protocol])
                    )
                    rates[protocol][concurrency].append(rate)
                    costs[protocol][concurrency].append(cost)
                if round_index == 0 and not args.no_attacks:
                    attacks[protocol] = {
                        "huge_header": huge_header(port, process),
                        "half_sent": half_sent(port, process),
                        "probe_under_attack": probe_under_attack(port),
                    }
            print(round_index, protocol, {c: round(r[-1], 1) for c, r in costs[protocol].items()})
        result_file.write(
            {"rounds_done": round_index + 1, "server_cpu_us_per_event": costs}, complete=False
        )
    return rates, costs, errors, attacks


def _cpu_ratios(costs: dict[str, dict[int, list[float]]], protocols: list[str]) -> dict:
    """Each protocol's server CPU per event over httptools', round by round, per concurrency."""
    return {
        p: {
            str(c): spread(
                [a / b for a, b in zip(costs[p][c], costs["httptools"][c], strict=True)], 3
            )
            for c in (1, 64)
        }
        for p in protocols
    }


if __name__ == "__main__":
    raise SystemExit(main())
