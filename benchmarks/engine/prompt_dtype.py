"""Prompt steps multiplied in bfloat16 against float32, side by side in one run.

    python -m benchmarks.engine.prompt_dtype           # -> benchmarks/results/prompt_dtype.json
    python -m benchmarks.engine.prompt_dtype --scratch --case 1:64 --rounds 2  # quick

One engine per ``prompt_matmul_dtype`` (float32, bfloat16) on the same loaded file, prefix
caching off; each case ``prompts:tokens`` adds ``prompts`` prompts of ``tokens`` random tokens at
once and times the steps until each has its first token (what a prefill worker computes; the
quantized layers beyond ``NATIVE_MAX_ROWS`` rows run the tiled GEMM, in the side's dtype). The
sides run back to back in each round, their order rotating (``benchmarks.harness.rounds``); the
speed-up is float32's time over bfloat16's, round by round, judged against ``GOAL``: bfloat16
prompts may be the default only where they are faster. The CPU's ISA (``_meta``) says whether
bfloat16 ran on native instructions (``avx512_bf16``, ``amx_bf16``) or was emulated.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.engine.kv_dtype import add_case_arguments, parse_case
from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import paired_rounds
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

SIDES = ("float32", "bfloat16")
GOAL = Goal(1.0)  # float32 seconds / bfloat16 seconds: bfloat16 must be faster
DEFAULT_CASES = ("1:512", "4:512", "1:2048")


def prompt_seconds(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Seconds until every prompt of ``prompts`` (added at once) has its first token; every
    request finished and freed after."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.request(f"p{i}", prompt, params))
    first = set()
    while engine.has_work():
        first.update(e.request_id for e in engine.step() if e.token_id is not None)
    elapsed = time.perf_counter() - start
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(first)} prompts had no first token")
    return elapsed


def _engine(loaded: Any, prompt_matmul_dtype: str, tokens: int, threads: int) -> LLMEngine:
    """An engine that computes a burst of up to ``tokens`` prompt tokens in one step (no step
    target), no prefix cache."""
    block_size = 128
    config = EngineConfig(
        device="cpu",
        prompt_matmul_dtype=prompt_matmul_dtype,
        num_threads=threads,
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=tokens // block_size + 64,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(max_prefill_tokens=max(tokens, 512), prompt_step_target_ms=0),
    )
    return LLMEngine(config, loaded)


def measure_case(
    engines: dict[str, LLMEngine], prompts: int, tokens: int, args: argparse.Namespace
) -> dict[str, Any]:
    vocab = next(iter(engines.values())).shape.vocab_size
    drawn = PromptDraw(args.seed, vocab).prompts(prompts, tokens, tokens)
    sides = {
        name: (lambda e=engine: 1000 * prompt_seconds(e, drawn)) for name, engine in engines.items()
    }

    def progress(index: int, values: dict[str, float]) -> None:
        shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in values.items())
        print(f"{prompts}:{tokens} round {index + 1}: {shown}", flush=True)

    kept = paired_rounds(sides, args.rounds, on_round=progress)
    speedups = [f / b for f, b in zip(kept["float32"], kept["bfloat16"], strict=True)]
    verdict = judge(speedups, GOAL)
    entry: dict[str, Any] = {
        "ms": {name: spread(values, 1) for name, values in kept.items()},
        "prompt_tokens_per_s": {
            name: round(prompts * tokens * 1000 / spread(values, 1)["median"], 1)
            for name, values in kept.items()
        },
        "bfloat16_speedup": {**spread(speedups, 3), "verdict": verdict.verdict},
    }
    print(f"{prompts}:{tokens} bfloat16: {entry['bfloat16_speedup']['median']}x, {verdict}")
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "prompt_dtype")
    parser.add_argument("--gguf", action="append", help="a file set (default: bundled)")
    add_case_arguments(parser, "prompts:tokens", DEFAULT_CASES)
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    cases = args.case or [parse_case(c) for c in DEFAULT_CASES]
    torch.set_num_threads(args.threads)
    most = max(prompts * tokens for prompts, tokens in cases)
    result: dict[str, Any] = {"goal": str(GOAL), "files": {}}
    for name in args.gguf or ["bundled"]:
        path = resolve_gguf(name)
        loaded = load_model("bundled" if name == "bundled" else str(path))
        engines = {side: _engine(loaded, side, most, args.threads) for side in SIDES}
        entry: dict[str, Any] = {"file": path.name, "engine": engines["bfloat16"].model.describe()}
        entry["cases"] = {}
        result["files"][name] = entry
        for prompts, tokens in cases:
            entry["cases"][f"{prompts}:{tokens}"] = measure_case(engines, prompts, tokens, args)
            result_file.write(result, complete=False)
        del engines, loaded
    result_file.write(result)


if __name__ == "__main__":
    main()
