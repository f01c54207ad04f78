"""Sampling one token from a 49,152-token vocabulary: pdserve's sampler against the full-sort
reference (transformers' top-k / top-p warpers, then a multinomial draw), side by side.

    python -m benchmarks.engine.sampling --out results/sampling.json

For each setting, ``--rows`` rows of random logits (peaked, as a trained model's are) are sampled
by both, alternating which goes first over ``--rounds`` rounds (the first dropped); the JSON
keeps microseconds per row for each side and the ratio reference / pdserve per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

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


def compare(params: SamplingParams, logits: torch.Tensor, rounds: int) -> list[tuple]:
    """(pdserve, reference) microseconds per row for each kept round."""
    row = _Row(params)
    generator = torch.Generator().manual_seed(7)

    def ours(x: torch.Tensor) -> int:
        return sample(x, [row])[0]

    def theirs(x: torch.Tensor) -> int:
        return reference(x, params, generator)

    kept = []
    for index in range(rounds):
        if index % 2 == 0:
            a, b = time_rows(ours, logits), time_rows(theirs, logits)
        else:
            b, a = time_rows(theirs, logits), time_rows(ours, logits)
        if index > 0:
            kept.append((a, b))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 4.0
    results: dict[str, dict] = {}
    print(f"{'us per row':<20}{'pdserve':>12}{'reference':>12}{'speed-up':>12}")
    for name, fields in SETTINGS.items():
        kept = compare(SamplingParams(seed=7, **fields), logits, args.rounds)
        results[name] = {
            "pdserve_us": round(statistics.median(a for a, _ in kept), 1),
            "reference_us": round(statistics.median(b for _, b in kept), 1),
            "speedup": {
                "median": round(statistics.median(b / a for a, b in kept), 2),
                "min": round(min(b / a for a, b in kept), 2),
                "max": round(max(b / a for a, b in kept), 2),
            },
        }
        r = results[name]
        print(
            f"{name:<20}{r['pdserve_us']:>12.1f}{r['reference_us']:>12.1f}"
            f"{r['speedup']['median']:>11.2f}x"
        )
    results["_meta"] = {"vocab": VOCAB, "rows": args.rows, "rounds": args.rounds,
                        "threads": args.threads, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
