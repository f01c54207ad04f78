"""The coordinator's own overhead: streaming ``/infer`` against the cluster API, same actors;
and ``/v1/embeddings`` through the cluster against the encoder called in-process.

    python benchmarks/bench_coordinator.py --out results/coordinator.json

One cluster (pd_separate, 1 prefill + 1 decode, bundled model unless ``--model``) serves both
paths, measured alternately: ``direct`` calls ``Cluster.generate`` from this process;
``http`` sends ``POST /infer_token`` with ``stream: true`` to the real coordinator app (uvicorn,
in a thread of this process) over loopback and parses the SSE events. Same prompts (random token
ids), greedy, same lengths. For 1 and 64 concurrent streams it reports delivered tokens/s and the
p50/p99 time between tokens seen by the client; the figure of merit is how much the coordinator
adds to the mean time per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from coordinator.config import load_config
from coordinator.server import Coordinator
from engine.sampling_params import SamplingParams
from engine.worker.contracts import GenerationRequest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(streams: list[list[float]], wall_s: float) -> dict[str, float]:
    gaps = [b - a for times in streams for a, b in zip(times, times[1:], strict=False)]
    tokens = sum(len(times) for times in streams)
    return {
        "tokens_per_s": round(tokens / wall_s, 2),
        "tpot_ms": round(statistics.mean(gaps) * 1000, 3),
        "p50_gap_ms": round(_percentile(gaps, 0.5) * 1000, 3),
        "p99_gap_ms": round(_percentile(gaps, 0.99) * 1000, 3),
        "tokens": tokens,
    }


async def direct_stream(coordinator: Coordinator, prompt: list[int], tokens: int) -> list[float]:
    times = []
    request_id = coordinator.service.new_request_id()
    params = SamplingParams(max_new_tokens=tokens, seed=1)
    async for event in coordinator.cluster.generate(GenerationRequest(request_id, prompt, params)):
        if event.token_id is not None:
            times.append(time.monotonic())
    return times


async def http_stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int
) -> list[float]:
    times = []
    body = {"input_id": prompt, "stream": True, "parameters": {"max_new_tokens": tokens, "seed": 1}}
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                times.append(time.monotonic())
    return times


async def measure(
    coordinator: Coordinator, url: str, prompts: list[list[int]], tokens: int, rounds: int
) -> dict[str, dict[str, float]]:
    results: dict[str, list] = {"direct": [], "http": []}
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for _ in range(rounds):
            for path in ("direct", "http"):
                start = time.monotonic()
                if path == "direct":
                    streams = await asyncio.gather(
                        *[direct_stream(coordinator, p, tokens) for p in prompts]
                    )
                else:
                    streams = await asyncio.gather(
                        *[http_stream(client, url, p, tokens) for p in prompts]
                    )
                results[path].append(_summary(streams, time.monotonic() - start))
    return {
        path: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for path, runs in results.items()
    }


async def measure_embeddings(url: str, batch: int, requests: int) -> dict[str, float]:
    """Inputs per second: ``requests`` calls of ``batch`` inputs, 8 in flight, through HTTP,
    against the same encoder called directly in this process."""
    from engine.embedding_model import EmbeddingModel

    texts = [f"sentence number {i} about prefill and decode" for i in range(batch)]
    direct = EmbeddingModel()
    direct.embed(texts)
    start = time.monotonic()
    for _ in range(requests):
        direct.embed(texts)
    direct_rate = batch * requests / (time.monotonic() - start)
    async with httpx.AsyncClient(timeout=600) as client:
        await client.post(url, json={"input": texts})
        gate = asyncio.Semaphore(8)

        async def one() -> None:
            async with gate:
                response = await client.post(url, json={"input": texts})
                response.raise_for_status()

        start = time.monotonic()
        await asyncio.gather(*[one() for _ in range(requests)])
        http_rate = batch * requests / (time.monotonic() - start)
    return {
        "direct_inputs_per_s": round(direct_rate, 1),
        "http_inputs_per_s": round(http_rate, 1),
        "ratio": round(http_rate / direct_rate, 3),
    }


def start_server(coordinator: Coordinator) -> threading.Thread:
    config = coordinator.uvicorn_configs()[0]
    server = uvicorn.Server(config)

    def run() -> None:
        asyncio.run(server.serve())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    config = load_config(None).with_overrides(
        {
            "backend_config.model_path": args.model,
            "http_config.predict_port": port,
            "backend_config.maxIterTimes": args.tokens,
        }
    )
    coordinator = Coordinator(config)

    async def run() -> dict:
        await coordinator.start()
        start_server(coordinator)
        url = f"http://127.0.0.1:{port}/infer_token"
        rng = random.Random(0)
        out = {}
        for concurrency in args.concurrency:
            prompts = [
                [
                    rng.randrange(100, coordinator.model.vocab_size)
                    for _ in range(args.prompt_tokens)
                ]
                for _ in range(concurrency)
            ]
            figures = await measure(coordinator, url, prompts, args.tokens, args.rounds)
            figures["added_tpot"] = round(
                figures["http"]["tpot_ms"] / figures["direct"]["tpot_ms"] - 1, 4
            )
            out[str(concurrency)] = figures
            print(
                f"{concurrency:>3} streams  direct {figures['direct']}\n"
                f"{'':>11}  http   {figures['http']}\n"
                f"{'':>11}  the coordinator adds {figures['added_tpot']:+.1%} to TPOT"
            )
        embeddings_url = f"http://127.0.0.1:{port}/v1/embeddings"
        out["embeddings"] = {}
        for batch in (1, 64):
            figures = await measure_embeddings(embeddings_url, batch, 64 if batch == 1 else 16)
            out["embeddings"][str(batch)] = figures
            print(f"embeddings batch {batch:>2}: {figures}")
        await coordinator.shutdown()
        return out

    results = asyncio.run(run())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
