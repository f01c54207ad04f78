"""Serving benchmark: Poisson load against pdserve or any OpenAI-compatible server; TTFT, TPOT,
inter-token gaps, end-to-end latency, throughput and goodput under SLOs.

    python -m benchmarks.serving.sweep --url http://127.0.0.1:1025 --api infer \\
        --request-rates 0.5,1,2 --num-requests 40 --scratch
    python -m benchmarks.serving.sweep --url http://127.0.0.1:8080 --api chat --model m ...
    python -m benchmarks.serving.sweep --write-dataset mix.jsonl --num-requests 200

Workload: ``--dataset FILE.jsonl`` (prompt, output_tokens per line) or a synthetic ``--mix``.
With several rates (a sweep) it reports the highest rate whose SLO attainment is >= 90 %.
Writes the JSON (``benchmarks/results/serving.json`` by default; every request's timings too,
failed ones with their error) and PNG plots next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from benchmarks.harness.client import Target
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.serving.metrics import SLO
from benchmarks.serving.plots import plot_cdfs, plot_goodput
from benchmarks.serving.rate_sweep import add_sweep_arguments, print_report, sweep, workload
from benchmarks.serving.workload import write_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser)
    add_output_arguments(parser, "serving")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--write-dataset", help="write the synthetic workload here and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    items = workload(args)
    if args.write_dataset:
        write_dataset(items, args.write_dataset)
        print(f"wrote {len(items)} requests to {args.write_dataset}")
        return 0
    result_file = ResultFile.start(args, [__file__, *(sys.argv[1:] if argv is None else argv)])
    headers = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    target = Target(args.url.rstrip("/"), args.api, args.model, not args.no_ignore_eos, headers)
    result = asyncio.run(
        sweep(target, items, args, SLO(args.slo_ttft, args.slo_tpot, args.slo_itl))
    )
    out = result_file.write(result)
    print_report(result)
    if not args.no_plots:
        plot_cdfs({result["label"] or args.api: result}, out.with_suffix(".cdf.png"))
        plot_goodput({result["label"] or args.api: result}, out.with_suffix(".goodput.png"))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
