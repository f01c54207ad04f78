"""Where a decode step's time goes, fused decode layers against the op-by-op path, in one run.

    python -m benchmarks.engine.decode_step             # -> benchmarks/results/decode_step.json
    python -m benchmarks.engine.decode_step --scratch --tokens 8 --rounds 2   # quick

Runs the bundled model or ``--gguf``'s file (``--weight-dtype``, default ``auto``: the GGUF's
blocks; ``--activation-dtype`` for decode rows) decoding
``--tokens`` tokens for ``--streams`` sequences, and times the parts of every decode step:
  schedule  the scheduler picking the step
  prepare   the step's metadata built on the host (ids, positions, slots, block tables)
  layers    embedding, the decoder layers (one native call when fused; ~35 torch ops a layer
            otherwise) and the final norm
  head      the LM head over the sampled rows
  sample    choosing the tokens
  engine    the rest of the step: appending tokens, detokenizing, stop checks, events
Each part's milliseconds per step are the median over ``--rounds`` kept rounds (5 by default,
after one warm-up round), the two paths back to back in each, alternating which goes first; the
step's speed-up of the fused path is taken within each round (``_fused_speedup``, with the
bootstrap interval of its median). Prefill steps are not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, order_of
from benchmarks.harness.stats import spread
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from engine import llm_engine
from engine.config import WEIGHT_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "layers", "head", "sample", "engine")


class StepClock:
    """Wraps the engine's parts with timers; keeps the totals of decode-only steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.current: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        scheduler, runner, model = engine.scheduler, engine.runner, engine.model
        scheduler.schedule = self._timed("schedule", scheduler.schedule)
        runner.prepare = self._timed("prepare", runner.prepare)
        model.forward = self._timed("forward", model.forward)
        lm_head = model.lm_head
        model.lm_head = self._timed("head_projection", lm_head)
        self._sample = self._timed("sample", llm_engine.sample)

    def _timed(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        return timed

    def run(self, prompts: list[list[int]], tokens: int) -> dict[str, float]:
        """Milliseconds per decode step, by part."""
        self.totals.clear()
        self.steps = 0
        original, llm_engine.sample = llm_engine.sample, self._sample
        try:
            params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                self.engine.add_request(self.engine.request(f"r{i}", prompt, params))
            while self.engine.has_work():
                self.current.clear()
                prefills = bool(self.engine.scheduler.waiting)
                start = time.perf_counter()
                self.engine.step()
                self.current["step"] = time.perf_counter() - start
                if not prefills:
                    self.steps += 1
                    for part, seconds in self.current.items():
                        self.totals[part] += seconds
        finally:
            llm_engine.sample = original
        t = {part: 1000 * seconds / self.steps for part, seconds in self.totals.items()}
        head = t.get("head_projection", 0.0)
        return {
            "schedule": t["schedule"],
            "prepare": t["prepare"],
            "layers": t["forward"] - head,
            "head": head,
            "sample": t["sample"],
            "engine": t["step"] - t["schedule"] - t["prepare"] - t["forward"] - t["sample"],
            "step": t["step"],
        }


def _parser() -> argparse.ArgumentParser:
    """The command line of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "decode_step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    parser.add_argument("--gguf", default="bundled", help="a file set (default: bundled)")
    parser.add_argument("--activation-dtype", default="auto", help="decode rows' activations")
    return parser


def main() -> None:
    args = _parser().parse_args()
    result_file = ResultFile.start(args)
    torch.set_num_threads(args.threads)
    path = resolve_gguf(args.gguf)
    config = EngineConfig(
        device="cpu", weight_dtype=args.weight_dtype, activation_dtype=args.activation_dtype
    )
    engine = LLMEngine(config, load_model("bundled" if args.gguf == "bundled" else str(path)))
    fused = engine.model.fused
    if fused is None:
        raise SystemExit("the fused decode layers are not available here (no native kernels)")
    weights = engine.model.describe()
    kept = _measure(engine, fused, args)
    result_file.write(_report(kept, args, weights))


def _measure(
    engine: LLMEngine, fused: object, args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """Each kept round's decode-step parts, fused and op by op, the order rotating by round."""
    clock = StepClock(engine)
    prompts = PromptDraw(1).prompts(args.streams, 64, 64)  # decode only: prefill not timed
    paths = {"fused": fused, "op_by_op": None}
    kept: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for index in range(DEFAULT_WARMUP + args.rounds):
        for name in order_of(list(paths), index):
            engine.model.fused = paths[name]
            result = clock.run(prompts, args.tokens)
            if index >= DEFAULT_WARMUP:
                kept[name].append(result)
    return kept


def _report(
    kept: dict[str, list[dict[str, float]]], args: argparse.Namespace, weights: str
) -> dict[str, dict]:
    """The median parts of each path and the fused speed-up, printed; the result file's JSON."""
    results: dict[str, dict] = {}
    print(f"ms per decode step, {args.streams} stream(s), {weights}")
    print(f"{'':<10}" + "".join(f"{part:>10}" for part in (*PARTS, "step")))
    for name, rounds in kept.items():
        medians = {p: statistics.median(r[p] for r in rounds) for p in (*PARTS, "step")}
        results[name] = {p: round(v, 3) for p, v in medians.items()}
        print(f"{name:<10}" + "".join(f"{medians[p]:>10.3f}" for p in (*PARTS, "step")))
    speedups = [s["step"] / f["step"] for f, s in zip(kept["fused"], kept["op_by_op"], strict=True)]
    results["_fused_speedup"] = spread(speedups)
    print(f"fused speed-up of a step: {results['_fused_speedup']}")
    results["_meta"] = {
        "kernel_isa": _kernel_isa(),
        "streams": args.streams,
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "dropped_rounds": DEFAULT_WARMUP,
        "weights": weights,
    }
    return results


def _kernel_isa() -> str:
    from engine.kernels.quantized import quantized_kernels

    module = quantized_kernels()
    return module.isa() if module is not None and hasattr(module, "isa") else "torch"


if __name__ == "__main__":
    main()
