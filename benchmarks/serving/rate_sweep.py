"""The serving sweep itself, shared by ``sweep`` and ``compare_modes``: its settings, the workload
they name, one rate's load against a target and the sweep over rates, and the table printed of
it. Poisson load against pdserve or any OpenAI-compatible server; TTFT, TPOT, inter-token gaps,
end-to-end latency, throughput and goodput under SLOs."""

from __future__ import annotations

import argparse
from typing import Any

import httpx

from benchmarks.harness.client import APIS, Target, send
from benchmarks.harness.load import run_load
from benchmarks.serving.metrics import SLO, max_rate_within_slo, summarize
from benchmarks.serving.workload import DEFAULT_MIX, WorkItem, load_dataset, parse_mix, synthetic


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings of a sweep: target, workload, rates, arrivals, SLOs."""
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
    parser.add_argument("--no-progress", action="store_true")


def sweep_args(argv: list[str]) -> argparse.Namespace:
    """A sweep's settings from command-line words (the defaults for the rest)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_sweep_arguments(parser)
    return parser.parse_args(argv)


def make_encoder(tokenizer: str):
    """A tokenizer's encode, to size synthetic prompts (None: about 1.3 tokens per word)."""
    if tokenizer == "none":
        return None
    from engine.model.model_files import load_tokenizer, tokenizer_dir

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
    result = {
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
    return result | flag_failures(runs)


def flag_failures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"failed_requests": {count, examples}}`` when a run of ``runs`` failed requests (each
    summary's ``failed_requests``), else nothing."""
    failed = [s["failed_requests"] for run in runs if (s := run["summary"]).get("failed_requests")]
    if not failed:
        return {}
    examples = sorted({e for f in failed for e in f["examples"]})[:5]
    return {"failed_requests": {"count": sum(f["count"] for f in failed), "examples": examples}}


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
    if result.get("failed_requests"):
        failed = result["failed_requests"]
        print(f"FAILED requests: {failed['count']}, e.g. {failed['examples'][:2]}")


def _f(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.2f}"
