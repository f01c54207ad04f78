"""Where a single served stream's time per token goes: the worker cluster reached straight over
Ray (with its engine's own gap between tokens), and pdserve's ``/v1/completions`` stream, side by
side in one run.

    python -m benchmarks.serving.stream_path          # benchmarks/results/stream_path.json
    python -m benchmarks.serving.stream_path --modes single_node --rounds 2 --new-tokens 32 \\
        --scratch

Each round measures, one after the other (the order alternating), for every mode:
  cluster  a ``Cluster`` of the mode's actors on a local Ray, one request through
           ``Cluster.generate``: the engine's own gap between tokens (``emitted_at``), the gap at
           the receiver, the lag from a token's sampling to its arrival, and this process's CPU
           per token (what Ray's stream costs its receiver)
  served   pdserve started in the mode, one ``/v1/completions`` stream (greedy, ``ignore_eos``):
           the gap between SSE chunks at the client, and the coordinator's and the client's CPU
           per token
Every figure is a median over a request's tokens (first token excluded); the JSON keeps each
round's, their median with its bootstrap interval, min and max (``benchmarks.harness.stats``),
and per round served / the cluster's engine gap (the engine as it runs in the workers: their
threads, their cores). On a machine of few cores
every CPU millisecond spent outside the engine per token is taken from the engine's threads, so
the CPU figures say as much as the gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.launch import start_pdserve, stop_pdserve
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.stats import spread

PROMPT_TEXT = " ".join(["the quick brown fox jumps over the lazy dog"] * 11)  # about 100 tokens
PROMPT_IDS = list(range(1000, 1100))


def prompt_ids(model: str) -> list[int]:
    """:data:`PROMPT_IDS`, moved below the vocabulary's end for a model with fewer ids."""
    from engine.model.loader import load_model

    vocab = load_model(model).hf_config.vocab_size
    start = min(PROMPT_IDS[0], vocab - len(PROMPT_IDS))
    return list(range(start, start + len(PROMPT_IDS)))


def process_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def own_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1e3


def gaps_ms(times: list[float]) -> float:
    """The median gap between consecutive tokens after the first, in ms."""
    if len(times) < 3:
        raise ValueError(f"{len(times)} tokens arrived apart: too few for a gap after the first")
    return statistics.median((b - a) * 1e3 for a, b in zip(times[1:], times[2:], strict=False))


async def cluster_gap(cluster: Any, new_tokens: int, ids: list[int]) -> dict[str, float]:
    from engine.sampling_params import SamplingParams
    from workers.contracts import GenerationRequest

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    request = GenerationRequest(f"direct-{time.monotonic_ns()}", ids, params)
    emitted, received, cpu = [], [], own_cpu_ms()
    async for event in cluster.generate(request):
        if event.token_id is not None:
            emitted.append(event.emitted_at)
            received.append(time.monotonic())
    lags = [(b - a) * 1e3 for a, b in zip(emitted[1:], received[1:], strict=False)]
    return {
        "engine_gap_ms": gaps_ms(emitted),
        "gap_ms": gaps_ms(received),
        "lag_ms": statistics.median(lags),
        "receiver_cpu_ms_per_token": (own_cpu_ms() - cpu) / len(received),
    }


async def served_gap(url: str, pid: int, new_tokens: int) -> dict[str, float]:
    body = {"prompt": PROMPT_TEXT, "max_tokens": new_tokens, "stream": True, "ignore_eos": True}
    times: list[float] = []
    cpu, client_cpu = process_cpu_ms(pid), own_cpu_ms()
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", url, json=body) as response,
    ):
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return {
        "gap_ms": gaps_ms(times[:-1]),  # the last chunk carries the finish, no new token
        "coordinator_cpu_ms_per_token": (process_cpu_ms(pid) - cpu) / len(times),
        "client_cpu_ms_per_token": (own_cpu_ms() - client_cpu) / len(times),
    }


def start_cluster(mode: str, model: str) -> Any:
    from coordinator.cluster import Cluster
    from coordinator.config.cluster import ClusterConfig
    from coordinator.ray_connect import init_ray
    from engine.config import EngineConfig

    init_ray()
    config = ClusterConfig(
        deploy_mode=mode,
        engine=EngineConfig(model_path=model, device="cpu"),
        embedding_model_path=None,
    )
    cluster = Cluster(config)
    cluster.fleet.start()
    return cluster


def measure_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every round of ``mode``: cluster and served figures."""
    ids = prompt_ids(args.model)
    cluster = start_cluster(mode, args.model)
    process, ports = start_pdserve(mode, args.model, Path(tempfile.mkdtemp()))
    url = f"http://127.0.0.1:{ports['predict_port']}/v1/completions"
    measures = {
        "cluster": lambda: asyncio.run(cluster_gap(cluster, args.new_tokens, ids)),
        "served": lambda: asyncio.run(served_gap(url, process.pid, args.new_tokens)),
    }
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for name in measures:  # warm-up, dropped
            measures[name]()
        for index in range(args.rounds):
            names = list(measures)[index % 2 :] + list(measures)[: index % 2]
            rounds.append({name: measures[name]() for name in names})
            print(mode, index, json.dumps(rounds[-1]), flush=True)
    finally:
        stop_pdserve(process, 60)
        cluster.fleet.shutdown()
    return summarize(rounds)


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layer in rounds[0]:
        out[layer] = {key: spread([r[layer][key] for r in rounds], 3) for key in rounds[0][layer]}
    out["served_over_engine"] = spread(
        [r["served"]["gap_ms"] / r["cluster"]["engine_gap_ms"] for r in rounds], 3
    )
    out["cluster_over_engine"] = spread(
        [r["cluster"]["gap_ms"] / r["cluster"]["engine_gap_ms"] for r in rounds], 3
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="single_node,pd_separate")
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    add_output_arguments(parser, "stream_path")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {
        "_meta": {"model": args.model, "rounds": args.rounds, "dropped_rounds": 1},
        "new_tokens": args.new_tokens,
        "prompt_tokens": len(PROMPT_IDS),
        "modes": {},
    }
    for mode in args.modes.split(","):
        result["modes"][mode] = measure_mode(mode, args)
        result_file.write(result, complete=False)
    print(json.dumps(result, indent=1))
    print(f"results: {result_file.write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
