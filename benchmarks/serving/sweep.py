"""Serving benchmark: Poisson load against pdserve or any OpenAI-compatible server; TTFT, TPOT,
inter-token gaps, end-to-end latency, throughput and goodput under SLOs.

    python -m benchmarks.serving.sweep --url http://127.0.0.1:1025 --api infer \\
        --request-rates 0.5,1,2 --num-requests 40 --out results/serving.json
    python -m benchmarks.serving.sweep --url http://127.0.0.1:8080 --api chat --model m ...
    python -m benchmarks.serving.sweep --write-dataset mix.jsonl --num-requests 200

Workload: ``--dataset FILE.jsonl`` (prompt, output_tokens per line) or a synthetic ``--mix``.
With several rates (a sweep) it reports the highest rate whose SLO attainment is >= 90 %.
Writes the JSON (every request's timings too) and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.client import APIS, Target, run_load, send
from benchmarks.serving.metrics import SLO, max_rate_within_slo, summarize
from benchmarks.serving.plots import plot_cdfs, plot_goodput
from benchmarks.serving.workload import (
    DEFAULT_MIX,
    WorkItem,
    load_dataset,
    parse_mix,
    synthetic,
    write_dataset,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:1025")
    parser.add_argument("--api", choices=APIS, default="infer")
    parser.add_argument("--model", default="", help="the OpenAI 'model' field")
    parser.add_argument("--api-key", default="", help="sent as Authorization: Bearer")
    parser.add_argument("--dataset", help="JSONL workload (prompt, output_tokens)")
    parser.add_argument("--mix", default=DEFAULT_MIX, help="synthetic kind=weight list")
    parser.add_argument("--tokenizer", default="bundled", help="sizes prompts: bundled|PATH|none")
    parser.add_argument("--num-requests", type=int, default=40, help="per rate")
    parser.add_argument("--request-rates", default="1", help="req/s, comma list; inf = at once")
    parser.add_argument("--concurrency", type=int, help="most requests in flight")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    parser.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.150, help="seconds")
    parser.add_argument("--slo-itl", type=float, help="seconds: a request's p99 inter-token gap")
    parser.add_argument("--no-ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="name of the deployment under test")
    parser.add_argument("--out", default="results/serving.json")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--write-dataset", help="write the synthetic workload here and exit")
    return parser.parse_args(argv)


def make_encoder(tokenizer: str):
    """A tokenizer's encode, to size synthetic prompts (None: about 1.3 tokens per word)."""
    if tokenizer == "none":
        return None
    from engine.model.loader import load_tokenizer, tokenizer_dir

    loaded = load_tokenizer(tokenizer_dir(tokenizer))
    return lambda text: loaded.encode(text, add_special_tokens=False)


def workload(args: argparse.Namespace) -> list[WorkItem]:
    if args.dataset:
        return load_dataset(args.dataset)[: args.num_requests]
    encode = make_encoder(args.tokenizer)
    return synthetic(args.num_requests, parse_mix(args.mix), encode, args.seed)


async def run_rate(
    target: Target, items: list[WorkItem], rate: float | None, args: Any, slo: SLO
) -> dict[str, Any]:
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(items), desc=f"{args.label or target.api} @ {rate} req/s")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600), limits=limits, headers=dict(target.headers)
    ) as client:
        records, duration = await run_load(
            items,
            lambda item: send(client, target, item),
            rate,
            args.concurrency,
            args.arrivals == "poisson",
            args.seed,
            progress.update if progress else None,
        )
    if progress:
        progress.close()
    return {
        "request_rate": rate if rate is not None else float("inf"),
        "summary": summarize(records, duration, slo),
        "requests": [r.to_dict() for r in records],
    }


async def sweep(target: Target, items: list[WorkItem], args: Any, slo: SLO) -> dict[str, Any]:
    rates = [None if r == "inf" else float(r) for r in args.request_rates.split(",")]
    runs = [await run_rate(target, items, rate, args, slo) for rate in rates]
    return {
        "label": args.label,
        "target": {"url": target.url, "api": target.api, "model": target.model},
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "itl_s": slo.itl_s},
        "workload": {
            "num_requests": len(items),
            "source": args.dataset or f"synthetic {args.mix}",
            "kinds": {k: sum(i.kind == k for i in items) for k in {i.kind for i in items}},
        },
        "runs": runs,
        "max_rate_within_slo": max_rate_within_slo(runs),
    }


def print_report(result: dict[str, Any]) -> None:
    slo = SLO(**result["slo"])
    print(f"{result['label'] or result['target']['api']}: SLO {slo.describe()}")
    print(
        f"{'rate':>6} {'ok':>5} {'req/s':>6} {'tok/s':>7} {'goodput':>7} {'attain':>6} "
        f"{'TTFT p50/p99 s':>15} {'TPOT p50/p99 ms':>16} {'E2E p99 s':>9}"
    )
    for run in result["runs"]:
        s = run["summary"]
        ttft, tpot, e2e = s["ttft_s"], s["tpot_s"], s["e2e_s"]
        print(
            f"{run['request_rate']:>6} {s['num_succeeded']:>5} {s['request_throughput']:>6.2f} "
            f"{s['output_token_throughput']:>7.1f} {s['goodput']:>7.2f} "
            f"{s['slo_attainment']:>6.0%} {_f(ttft['p50'])}/{_f(ttft['p99']):<7} "
            f"{_f(tpot['p50'], 1000)}/{_f(tpot['p99'], 1000):<8} {_f(e2e['p99']):>9}"
        )
    print(f"max rate with SLO attainment >= 90 %: {result['max_rate_within_slo']}")


def _f(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    items = workload(args)
    if args.write_dataset:
        write_dataset(items, args.write_dataset)
        print(f"wrote {len(items)} requests to {args.write_dataset}")
        return 0
    headers = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    target = Target(args.url.rstrip("/"), args.api, args.model, not args.no_ignore_eos, headers)
    result = asyncio.run(
        sweep(target, items, args, SLO(args.slo_ttft, args.slo_tpot, args.slo_itl))
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_report(result)
    if not args.no_plots:
        plot_cdfs({result["label"] or args.api: result}, out.with_suffix(".cdf.png"))
        plot_goodput({result["label"] or args.api: result}, out.with_suffix(".goodput.png"))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
