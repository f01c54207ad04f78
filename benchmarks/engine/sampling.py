"""Sampling one token from a 49,152-token vocabulary: pdserve's sampler against the full-sort
reference (transformers' top-k / top-p warpers, then a multinomial draw), side by side.

    python -m benchmarks.engine.sampling [--scratch] [--out PATH]

For each setting, ``--rows`` rows of random logits (peaked, as a trained model's are) are sampled
by both in paired rounds (``benchmarks.harness.rounds``: alternating which goes first, one round
dropped, ``--rounds`` kept); the JSON keeps microseconds per row for each side and the speed-up
reference / pdserve round by round, each with its median and bootstrap interval
(``benchmarks.harness.stats.spread``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds, ratio_rounds
from benchmarks.harness.stats import spread
from engine.sampler import sample
from engine.sampling_params import SamplingParams

VOCAB = 49152
SETTINGS = {
    "greedy": {},
    "temperature": {"do_sample": True, "temperature": 0.8},
    "top_k50": {"do_sample": True, "temperature": 0.8, "top_k": 50},
    "top_p0.9": {"do_sample": True, "temperature": 0.8, "top_p": 0.9},
    "top_k50_top_p0.9": {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.9},
}


class _Row:
    """What the sampler reads of a request."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        self.num_output_tokens = 0
        self.token_ids: list[int] = []
        self.output_token_ids: list[int] = []
        self.grammar = None  # unconstrained


def reference(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if not params.do_sample:
        return int(logits.argmax())
    scores = logits / params.temperature
    if params.top_k:
        scores = TopKLogitsWarper(top_k=params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=params.top_p)(None, scores)
    return int(torch.multinomial(torch.softmax(scores, -1), 1, generator=generator))


def time_rows(fn, rows: torch.Tensor) -> float:
    start = time.perf_counter()
    for i in range(rows.shape[0]):
        fn(rows[i : i + 1])
    return 1e6 * (time.perf_counter() - start) / rows.shape[0]


def sides(params: SamplingParams, logits: torch.Tensor) -> dict[str, Callable[[], float]]:
    """pdserve's sampler and the reference, each timing every row once (microseconds a row)."""
    row = _Row(params)
    generator = torch.Generator().manual_seed(7)

    def ours(x: torch.Tensor) -> int:
        return sample(x, [row])[0]

    def theirs(x: torch.Tensor) -> int:
        return reference(x, params, generator)

    return {
        "pdserve": lambda: time_rows(ours, logits),
        "reference": lambda: time_rows(theirs, logits),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "sampling")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.rows < 1 or args.rounds < 1:
        parser.error("--rows and --rounds must be at least 1")
    result = ResultFile.start(args)
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4.0
    results: dict[str, dict] = {"_meta": _meta(args)}
    print(f"{'us per row':<20}{'pdserve':>12}{'reference':>12}{'speed-up [95% interval]':>26}")
    for name, fields in SETTINGS.items():
        params = SamplingParams(seed=7, **fields)
        kept = paired_rounds(sides(params, logits), args.rounds, DEFAULT_WARMUP)
        results[name] = {
            "pdserve_us": spread(kept["pdserve"], 1),
            "reference_us": spread(kept["reference"], 1),
            "speedup": spread(ratio_rounds(kept, "reference", "pdserve"), 2),
        }
        r = results[name]
        speedup = r["speedup"]
        print(
            f"{name:<20}{r['pdserve_us']['median']:>12.1f}{r['reference_us']['median']:>12.1f}"
            f"{speedup['median']:>11.2f}x [{speedup['low']:.2f}-{speedup['high']:.2f}]",
            flush=True,
        )
        result.write(results, complete=False)
    path = result.write(results)
    print(f"results: {path}")


def _meta(args: argparse.Namespace) -> dict:
    return {
        "vocab": VOCAB,
        "rows": args.rows,
        "rounds": args.rounds,
        "dropped_rounds": DEFAULT_WARMUP,
        "threads": torch.get_num_threads(),
        "order": "alternating within rounds (A B, B A, ...), pdserve first in the dropped round",
        "speedup": "reference / pdserve microseconds a row, round by round",
    }


if __name__ == "__main__":
    main()
