"""A burst: many requests at once, each on a connection of its own, against a pool too small to
serve them all within their timeout. What a user of the burst hears, and when: served (200),
refused (429, with ``Retry-After``), timed out (408), anything else; the served requests per
second; the CPU seconds the coordinator and the workers spent on it; and, after it, the decode
workers' lapsed leases and blocks still in use.

    python -m benchmarks.serving.burst                      # -> benchmarks/results/burst.json
    python -m benchmarks.serving.burst --scratch --requests 60 --schedule-timeout-s 10

pdserve runs once for the whole run (``pd_separate``, the fixed split: every prompt handed off,
so every request waits on the decode worker's KV room), with ``--kv-cache-mb`` of KV cache per
engine and ``exception_config.schedule_timeout`` of ``--schedule-timeout-s`` (how long a request
may wait for its first token, and a hand-off for room). The sizes of ``--requests`` are the sides
of paired rounds (:mod:`benchmarks.harness.rounds`: each size once a round, the order alternating,
``--warmup`` rounds dropped), each burst ``SETTLE_S`` after the last one's requests all ended; the
goal, the last size's served requests a second at least the first's, is judged on the per-round
ratio. Prompts are ~100 tokens of random words (none from the prefix cache, none repeated between
bursts), ``--new-tokens`` greedy tokens each (``ignore_eos``), ``/v1/completions`` without
streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.harness.launch import FIXED, start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds, summarize
from benchmarks.harness.stats import Goal, judge
from benchmarks.serving.served_stream import PromptSource, prompt_words

SETTLE_S = 5.0  # after a burst, for the workers' blocks to come free
CLIENT_SLACK_S = 60.0  # a client waits this much longer than the server's timeout
GOAL = Goal(1.0)  # the largest burst's served requests a second over the smallest's


async def _one(url: str, body: dict[str, Any], timeout_s: float) -> tuple[str, float, str]:
    """(outcome, seconds to the answer, Retry-After) of one request on a connection of its own."""
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            answer = await client.post(url, json=body)
        outcome = str(answer.status_code)
        retry_after = answer.headers.get("retry-after", "")
    except httpx.HTTPError as exc:
        outcome, retry_after = type(exc).__name__, ""
    return outcome, time.monotonic() - started, retry_after


async def burst(
    url: str, requests: int, words: int, new_tokens: int, timeout_s: float, draw: str
) -> dict:
    """Send ``requests`` requests at once (prompts drawn as ``draw``); their outcomes, timings."""
    source = PromptSource(words, f"burst-{requests}-{draw}")
    bodies = [
        {"prompt": source.item(new_tokens).prompt, "max_tokens": new_tokens, "ignore_eos": True}
        for _ in range(requests)
    ]
    started = time.monotonic()
    answers = await asyncio.gather(*(_one(url, body, timeout_s) for body in bodies))
    took = time.monotonic() - started
    outcomes = Counter(outcome for outcome, _, _ in answers)
    served = [seconds for outcome, seconds, _ in answers if outcome == "200"]
    refused = [seconds for outcome, seconds, _ in answers if outcome == "429"]
    retry_after = [int(after) for outcome, _, after in answers if outcome == "429" and after]
    return {
        "requests": requests,
        "outcomes": dict(outcomes),
        "seconds": round(took, 2),
        "served_per_s": round(len(served) / max(max(served, default=took), 1e-9), 3),
        "served_s_p50": _median(served),
        "refused_s_p50": _median(refused),
        "refused_s_max": round(max(refused), 3) if refused else None,
        "retry_after_s_p50": _median([float(a) for a in retry_after]),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def instances(manage_url: str) -> list[dict[str, Any]]:
    """Every worker's row of ``/v1/instances``."""
    return httpx.get(f"{manage_url}/v1/instances", timeout=10).json()["instances"]


def decode_workers(manage_url: str) -> list[dict[str, Any]]:
    return [row for row in instances(manage_url) if row.get("role") == "decode"]


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU seconds so far of the processes ``pids`` (those gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def worker_pids(manage_url: str) -> list[int]:
    return [int(row["pid"]) for row in instances(manage_url) if row.get("pid")]


def lapsed_leases(manage_url: str) -> int:
    """Leases lapsed on every decode worker since it started."""
    return sum(w.get("num_leases_expired", 0) for w in decode_workers(manage_url))


def size_summary(size: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One burst size over the kept rounds: outcomes summed, timings' medians, the worst after."""
    outcomes: Counter[str] = Counter()
    for run in runs:
        outcomes.update(run["outcomes"])

    def median_of(key: str) -> float | None:
        return _median([run[key] for run in runs if run[key] is not None])

    return {
        "requests": size,
        "rounds": len(runs),
        "outcomes": dict(outcomes),
        "served_per_s": median_of("served_per_s"),
        "served_s_p50": median_of("served_s_p50"),
        "refused_s_p50": median_of("refused_s_p50"),
        "refused_s_max": max((r["refused_s_max"] or 0 for r in runs), default=None) or None,
        "retry_after_s_p50": median_of("retry_after_s_p50"),
        "coordinator_cpu_s": median_of("coordinator_cpu_s"),
        "workers_cpu_s": median_of("workers_cpu_s"),
        "leases_expired": sum(run["leases_expired"] for run in runs),
        "blocks_in_use_after": max(run["blocks_in_use_after"] for run in runs),
        "runs": runs,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--requests", default="300,600", help="burst sizes, in order")
    parser.add_argument("--kv-cache-mb", type=int, default=24)
    parser.add_argument("--schedule-timeout-s", type=int, default=120)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="rounds dropped")
    parser.add_argument("--logs", type=Path, help="keep pdserve's log here")
    add_output_arguments(parser, "burst")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    sizes = [int(size) for size in args.requests.split(",") if size]
    words = prompt_words(args.model)
    backend = {**FIXED, "kvCacheMemoryMB": args.kv_cache_mb}
    sections = {"exception_config": {"schedule_timeout": args.schedule_timeout_s}}
    workdir = args.logs or Path("/tmp/pdserve-burst")
    process, ports = start_pdserve("pd_separate", args.model, workdir, backend, None, sections)
    url = f"http://127.0.0.1:{ports['predict_port']}/v1/completions"
    manage = f"http://127.0.0.1:{ports['manage_port']}"
    timeout_s = args.schedule_timeout_s + CLIENT_SLACK_S
    runs: dict[str, list[dict[str, Any]]] = {str(size): [] for size in sizes}

    def side(size: int) -> Callable[[], float]:
        def measure() -> float:
            lapsed = lapsed_leases(manage)
            workers = worker_pids(manage)
            cpu_before = cpu_seconds([process.pid]), cpu_seconds(workers)
            draw = str(len(runs[str(size)]))
            run = asyncio.run(burst(url, size, words, args.new_tokens, timeout_s, draw))
            # CPU the burst took, this client's own not counted: does the coordinator take the
            # two cores' time from the workers as a burst grows?
            run["coordinator_cpu_s"] = round(cpu_seconds([process.pid]) - cpu_before[0], 2)
            run["workers_cpu_s"] = round(cpu_seconds(workers) - cpu_before[1], 2)
            time.sleep(SETTLE_S)
            run["leases_expired"] = lapsed_leases(manage) - lapsed
            run["blocks_in_use_after"] = sum(
                w.get("num_used_blocks", 0) for w in decode_workers(manage)
            )
            print(run, flush=True)
            runs[str(size)].append(run)
            return float(run["served_per_s"])

        return measure

    try:
        kept = paired_rounds({str(size): side(size) for size in sizes}, args.rounds, args.warmup)
    finally:
        stop_pdserve(process)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    bursts = [size_summary(size, runs[str(size)][args.warmup :]) for size in sizes]
    result: dict[str, Any] = {
        "_meta": {"model": args.model},
        "settings": settings,
        "bursts": bursts,
    }
    if len(sizes) > 1:
        largest, smallest = str(sizes[-1]), str(sizes[0])
        ratio = summarize(kept, largest, smallest, 3)["ratio"]
        verdict = judge(ratio["rounds"], GOAL)
        result["throughput_ratio"] = {"ours": largest, "theirs": smallest, **ratio}
        result["goal"] = {"at_least": GOAL.value, "verdict": verdict.verdict}
        print(f"served a second, {largest} over {smallest}: {ratio} -> {verdict}")
    print(f"results: {result_file.write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
