"""A burst: many requests at once, each on a connection of its own, against a pool too small to
serve them all within their timeout. What a user of the burst hears, and when: served (200),
refused (429, with ``Retry-After``), timed out (408), anything else; the served requests per
second; and, after it, the decode workers' lapsed leases and blocks still in use.

    python -m benchmarks.serving.burst                      # -> benchmarks/results/burst.json
    python -m benchmarks.serving.burst --scratch --requests 60 --schedule-timeout-s 10

pdserve runs once for the whole run (``pd_separate``, the fixed split: every prompt handed off,
so every request waits on the decode worker's KV room), with ``--kv-cache-mb`` of KV cache per
engine and ``exception_config.schedule_timeout`` of ``--schedule-timeout-s`` (how long a request
may wait for its first token, and a hand-off for room); each size of ``--requests`` is sent once,
in order, ``SETTLE_S`` after the last one's requests all ended. Prompts are ~100 tokens of random
words (none from the prefix cache), ``--new-tokens`` greedy tokens each (``ignore_eos``),
``/v1/completions`` without streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.launch import FIXED, start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.serving.served_stream import PromptSource, prompt_words

SETTLE_S = 5.0  # after a burst, for the workers' blocks to come free
CLIENT_SLACK_S = 60.0  # a client waits this much longer than the server's timeout


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


async def burst(url: str, requests: int, words: int, new_tokens: int, timeout_s: float) -> dict:
    """Send ``requests`` requests at once; their outcomes and timings."""
    source = PromptSource(words, f"burst-{requests}")
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


def decode_workers(manage_url: str) -> list[dict[str, Any]]:
    rows = httpx.get(f"{manage_url}/v1/instances", timeout=10).json()["instances"]
    return [row for row in rows if row.get("role") == "decode"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--requests", default="300,600", help="burst sizes, in order")
    parser.add_argument("--kv-cache-mb", type=int, default=24)
    parser.add_argument("--schedule-timeout-s", type=int, default=120)
    parser.add_argument("--new-tokens", type=int, default=4)
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
    runs = []
    try:
        for size in sizes:
            timeout_s = args.schedule_timeout_s + CLIENT_SLACK_S
            run = asyncio.run(burst(url, size, words, args.new_tokens, timeout_s))
            time.sleep(SETTLE_S)
            workers = decode_workers(manage)
            run["leases_expired"] = sum(w.get("num_leases_expired", 0) for w in workers)
            run["blocks_in_use_after"] = sum(w.get("num_used_blocks", 0) for w in workers)
            print(run, flush=True)
            runs.append(run)
    finally:
        stop_pdserve(process)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"_meta": {"model": args.model}, "settings": settings, "bursts": runs}
    print(f"results: {result_file.write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
