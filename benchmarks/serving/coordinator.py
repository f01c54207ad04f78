"""The coordinator's own overhead: streaming ``/infer`` against the cluster API, same actors;
and ``/v1/embeddings`` through the cluster against the same embedding worker in-process.

    python -m benchmarks.serving.coordinator          # benchmarks/results/coordinator.json
    python -m benchmarks.serving.coordinator --scratch --model DIR --tokens 4 \\
        --concurrency 2 --rounds 2 --embedding-batches 2 --embedding-requests 4   # a quick check

One cluster (pd_separate, 1 prefill + 1 decode, bundled model unless ``--model``) serves both
paths: ``direct`` calls ``Cluster.generate`` from this process; ``http`` sends
``POST /infer_token`` with ``stream: true`` to the real coordinator app (uvicorn, in a thread of
this process) over loopback and parses the SSE events. Same prompts (random token ids), greedy,
``ignore_eos``, the same number of concurrent streams. For each ``--concurrency`` it reports
delivered tokens/s and the p50/p99 time between tokens seen by the client; the figure of merit
is how much the coordinator adds to the mean time per output token.

Embeddings: ``http`` posts to ``/v1/embeddings`` (the cluster's embedding actor); ``direct`` calls
an ``EmbeddingWorker`` built in this process, the actor's own class with its batching thread and
its torch threads; both keep ``--in-flight`` calls going.

Every measure runs ``--rounds`` rounds; the two sides alternate which goes first; the first round
warms both up and is dropped. The JSON gives each figure's median (with its bootstrap interval),
min and max over the kept rounds (``benchmarks.harness.stats``), and the same for the per-round
ratio of the two sides. ``--embedding-model ""``: no embedding measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import uvicorn

from benchmarks.harness.launch import free_port
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.sse import sse_lines
from benchmarks.harness.stats import percentile
from benchmarks.harness.stats import spread as _spread
from coordinator.config.loader import load_config
from coordinator.server import Coordinator, SignalFreeServer
from engine.sampling_params import SamplingParams
from workers.contracts import GenerationRequest
from workers.embedding import EmbeddingWorker


def _summary(streams: list[list[float]], wall_s: float) -> dict[str, float]:
    gaps = [b - a for times in streams for a, b in zip(times, times[1:], strict=False)]
    tokens = sum(len(times) for times in streams)
    return {
        "tokens_per_s": round(tokens / wall_s, 2),
        "tpot_ms": round(statistics.mean(gaps) * 1000, 3),
        "p50_gap_ms": round(percentile(gaps, 50) * 1000, 3),
        "p99_gap_ms": round(percentile(gaps, 99) * 1000, 3),
        "tokens": tokens,
    }


async def direct_stream(coordinator: Coordinator, prompt: list[int], tokens: int) -> list[float]:
    times = []
    request_id = coordinator.service.new_request_id()
    params = SamplingParams(max_new_tokens=tokens, seed=1, ignore_eos=True)
    async for event in coordinator.cluster.generate(GenerationRequest(request_id, prompt, params)):
        if event.token_id is not None:
            times.append(time.monotonic())
    return times


async def http_stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int
) -> list[float]:
    times = []
    parameters = {"max_new_tokens": tokens, "seed": 1, "ignore_eos": True}
    body = {"input_id": prompt, "stream": True, "parameters": parameters}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in sse_lines(response):
            if line.startswith("data: "):
                json.loads(line[6:])
                times.append(time.monotonic())
    return times


async def _round(
    path: str, coordinator: Coordinator, client: httpx.AsyncClient, url: str, prompts, tokens: int
) -> dict[str, float]:
    start = time.monotonic()
    if path == "direct":
        streams = await asyncio.gather(*[direct_stream(coordinator, p, tokens) for p in prompts])
    else:
        streams = await asyncio.gather(*[http_stream(client, url, p, tokens) for p in prompts])
    return _summary(streams, time.monotonic() - start)


def _alternating(rounds: int) -> list[tuple[str, str]]:
    """The order of the two sides in each round: it alternates, so neither always goes first."""
    return [("direct", "http") if i % 2 == 0 else ("http", "direct") for i in range(rounds)]


async def measure(
    coordinator: Coordinator, url: str, prompts: list[list[int]], tokens: int, rounds: int
) -> dict[str, dict]:
    """Both paths, all streams at once, ``rounds`` alternating rounds; the first is a warm-up
    for both and is dropped."""
    kept: list[dict[str, dict[str, float]]] = []
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for index, order in enumerate(_alternating(rounds)):
            figures = {
                path: await _round(path, coordinator, client, url, prompts, tokens)
                for path in order
            }
            if index > 0:
                kept.append(figures)
    out: dict[str, dict] = {
        path: {key: _spread([r[path][key] for r in kept]) for key in kept[0][path]}
        for path in ("direct", "http")
    }
    out["added_tpot"] = _spread(
        [r["http"]["tpot_ms"] / r["direct"]["tpot_ms"] - 1 for r in kept], 4
    )
    return out


async def _embed_rate(call, batch: int, requests: int, in_flight: int) -> float:
    """Inputs per second over ``requests`` calls of ``batch`` inputs, ``in_flight`` at a time."""
    gate = asyncio.Semaphore(in_flight)

    async def one() -> None:
        async with gate:
            await call()

    start = time.monotonic()
    await asyncio.gather(*[one() for _ in range(requests)])
    return batch * requests / (time.monotonic() - start)


async def measure_embeddings(
    url: str, worker: EmbeddingWorker, batch: int, requests: int, rounds: int, in_flight: int
) -> dict[str, dict]:
    """``/v1/embeddings`` against the same worker class in this process: its batching thread,
    its torch threads, the same ``in_flight`` concurrent calls; alternating rounds, the first
    dropped."""
    texts = [f"sentence number {i} about prefill and decode" for i in range(batch)]
    loop = asyncio.get_running_loop()
    callers = ThreadPoolExecutor(in_flight)  # callers block on their future, as Ray's threads do

    async with httpx.AsyncClient(timeout=600) as client:

        async def direct() -> None:
            await loop.run_in_executor(callers, worker.embed, texts)

        async def http() -> None:
            response = await client.post(url, json={"input": texts})
            response.raise_for_status()

        sides = {"direct": direct, "http": http}
        kept = []
        for index, order in enumerate(_alternating(rounds)):
            rates = {
                side: await _embed_rate(sides[side], batch, requests, in_flight) for side in order
            }
            if index > 0:
                kept.append(rates)
    callers.shutdown()
    return {
        "direct_inputs_per_s": _spread([r["direct"] for r in kept], 1),
        "http_inputs_per_s": _spread([r["http"] for r in kept], 1),
        "ratio": _spread([r["http"] / r["direct"] for r in kept], 3),
    }


def _ms(spread: dict[str, float]) -> str:
    return f"{spread['median']:.2f} ms [{spread['min']:.2f}-{spread['max']:.2f}]"


async def start_server(coordinator: Coordinator) -> tuple[uvicorn.Server, asyncio.Task]:
    """The predict listener, on this event loop: the loop the coordinator's token channels and
    request queues live on, as in ``pdserve`` (a server on a loop of its own would wait on
    another loop's events, and may wait forever)."""
    server = SignalFreeServer(coordinator.uvicorn_configs()[0])
    serving = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped it
            raise RuntimeError("the predict listener stopped before it started")
        await asyncio.sleep(0.05)
    return server, serving


def _parser() -> argparse.ArgumentParser:
    """The command line of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "coordinator")
    parser.add_argument("--model", default="bundled")
    parser.add_argument(
        "--embedding-model", help="the cluster's embedding model (default: the config's; '': none)"
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=6, help="per measure; the first is dropped")
    parser.add_argument("--embedding-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--embedding-requests", type=int, default=32, help="calls per round")
    parser.add_argument("--in-flight", type=int, default=8, help="embedding calls at a time")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: the first is dropped")
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    port = free_port()
    overrides: dict[str, Any] = {
        "backend_config.model_path": args.model,
        "http_config.predict_port": port,
        "backend_config.maxIterTimes": args.tokens,
    }
    if args.embedding_model is not None:
        overrides["backend_config.embedding_model_path"] = args.embedding_model
    config = load_config(None).with_overrides(overrides)
    coordinator = Coordinator(config)
    results = asyncio.run(_run(coordinator, port, args, result_file))
    print(f"results: {result_file.write(results)}")
    return 0


async def _run(
    coordinator: Coordinator, port: int, args: argparse.Namespace, result_file: ResultFile
) -> dict:
    """The cluster and its HTTP server started, every measure run, the cluster shut down."""
    await coordinator.start()
    server, serving = await start_server(coordinator)
    out = await _stream_figures(coordinator, port, args, result_file)
    cluster = coordinator.cluster.config
    if cluster.embedding_model_path:
        out["embeddings"] = await _embedding_figures(
            cluster.embedding_model_path, cluster.embedding_resources.num_threads, port, args
        )
    server.should_exit = True
    await serving
    await coordinator.shutdown()
    out["_meta"] = {
        "model": args.model,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "dropped_rounds": 1,
        "order": "alternating, direct first in the dropped round",
        "embedding_in_flight": args.in_flight,
        "embedding_threads": cluster.embedding_resources.num_threads,
        "date": time.strftime("%Y-%m-%d"),
    }
    return out


async def _stream_figures(
    coordinator: Coordinator, port: int, args: argparse.Namespace, result_file: ResultFile
) -> dict[str, dict]:
    """Streaming ``/infer`` against the cluster API at each concurrency, each written as done."""
    url = f"http://127.0.0.1:{port}/infer_token"
    rng = random.Random(0)
    out: dict[str, dict] = {}
    for concurrency in args.concurrency:
        prompts = [
            [rng.randrange(100, coordinator.model.vocab_size) for _ in range(args.prompt_tokens)]
            for _ in range(concurrency)
        ]
        figures = await measure(coordinator, url, prompts, args.tokens, args.rounds)
        out[str(concurrency)] = figures
        result_file.write(out, complete=False)
        added = figures["added_tpot"]
        print(
            f"{concurrency:>3} streams  TPOT direct {_ms(figures['direct']['tpot_ms'])}, "
            f"http {_ms(figures['http']['tpot_ms'])}; the coordinator adds "
            f"{added['median']:+.1%} ({added['min']:+.1%} to {added['max']:+.1%})"
        )
    return out


async def _embedding_figures(
    model_path: str, threads: int, port: int, args: argparse.Namespace
) -> dict[str, dict]:
    """``/v1/embeddings`` against the worker in this process, at each batch size."""
    # The actor's own class and torch threads, in this process (sets this process's
    # torch threads, which nothing else here uses).
    worker = EmbeddingWorker(model_path, threads)
    embeddings_url = f"http://127.0.0.1:{port}/v1/embeddings"
    embeddings: dict[str, dict] = {}
    for batch in args.embedding_batches:
        figures = await measure_embeddings(
            embeddings_url,
            worker,
            batch,
            args.embedding_requests,
            args.rounds,
            args.in_flight,
        )
        embeddings[str(batch)] = figures
        print(f"embeddings batch {batch:>2}: {figures}")
    return embeddings


if __name__ == "__main__":
    sys.exit(main())
