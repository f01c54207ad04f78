"""Decode speed on a 16-bit KV cache against a float32 one, side by side in one run.

    python -m benchmarks.engine.kv_dtype                  # -> benchmarks/results/kv_dtype.json
    python -m benchmarks.engine.kv_dtype --scratch --case 2:64 --tokens 4 --rounds 2   # quick

One engine per ``kv_cache_dtype`` (float32, float16, bfloat16) on the same loaded file; each case
``streams:context`` puts ``streams`` sequences of ``context`` prompt tokens in every engine and
times ``--tokens`` decode steps of them (decode-only steps, prompts not timed; the prompts come
back from the prefix cache in later rounds, so a round costs little besides what it times). The
sides run back to back in each round, their order rotating (``benchmarks.harness.rounds``); each
16-bit side's speed-up is float32's step time over its own, round by round, judged against
``GOAL`` (not slower). Long contexts are where attention's bytes per token tell.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from engine.config import CacheConfig, EngineConfig
from engine.kv_cache import bytes_per_block
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

SIDES = ("float32", "float16", "bfloat16")
GOAL = Goal(1.0)  # a 16-bit cache may be the default only where it is not slower
DEFAULT_CASES = ("1:128", "1:2048", "32:512")


def parse_case(text: str) -> tuple[int, int]:
    """``streams:context`` as two positive integers."""
    streams, _, context = text.partition(":")
    if not (streams.isdigit() and context.isdigit() and int(streams) > 0 and int(context) > 0):
        raise argparse.ArgumentTypeError(f"a case is streams:context, got {text!r}")
    return int(streams), int(context)


def add_case_arguments(
    parser: argparse.ArgumentParser, case: str, defaults: tuple[str, ...]
) -> None:
    """The options both 16-bit benchmarks share: ``--case`` (``case`` names its two counts),
    ``--rounds``, ``--threads`` and ``--seed``."""
    parser.add_argument("--case", type=parse_case, action="append", help=f"{case} {defaults}")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5, help="seed of the random prompts")


def decode_ms_per_step(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> float:
    """Milliseconds per decode step of ``prompts`` for ``tokens`` steps once every prompt has
    its first token (prompt steps untimed); every request finished and freed after."""
    params = SamplingParams(max_new_tokens=tokens + 1, ignore_eos=True)
    emitted = {f"s{i}": 0 for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.request(f"s{i}", prompt, params))

    def step() -> None:
        for event in engine.step():
            if event.token_id is not None:
                emitted[event.request_id] += 1

    while not all(emitted.values()):
        step()
    steps, start = 0, time.perf_counter()
    while engine.has_work():
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    if any(n != tokens + 1 for n in emitted.values()):
        raise RuntimeError(f"a request did not decode its {tokens + 1} tokens: {emitted}")
    return 1000 * elapsed / steps


def _engine(loaded: Any, kv_cache_dtype: str, tokens: int, threads: int) -> LLMEngine:
    """An engine whose cache holds ``tokens`` (and room to spare) in ``kv_cache_dtype``."""
    block_size = 128
    config = EngineConfig(
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        num_threads=threads,
        cache=CacheConfig(block_size=block_size, num_blocks=tokens // block_size + 64),
    )
    return LLMEngine(config, loaded)


def measure_case(
    engines: dict[str, LLMEngine], streams: int, context: int, args: argparse.Namespace
) -> dict[str, Any]:
    vocab = next(iter(engines.values())).shape.vocab_size
    prompts = PromptDraw(args.seed, vocab).prompts(streams, context, context)
    sides = {
        name: (lambda e=engine: decode_ms_per_step(e, prompts, args.tokens))
        for name, engine in engines.items()
    }

    def progress(index: int, values: dict[str, float]) -> None:
        shown = ", ".join(f"{name} {ms:.1f} ms" for name, ms in values.items())
        print(f"{streams}:{context} round {index + 1}: {shown}", flush=True)

    kept = paired_rounds(sides, args.rounds, on_round=progress)
    entry: dict[str, Any] = {"ms_per_step": {n: spread(v, 2) for n, v in kept.items()}}
    for name in SIDES[1:]:
        speedups = [f / s for f, s in zip(kept["float32"], kept[name], strict=True)]
        verdict = judge(speedups, GOAL)
        entry[f"{name}_speedup"] = {**spread(speedups, 3), "verdict": verdict.verdict}
        print(f"{streams}:{context} {name}: {entry[f'{name}_speedup']['median']}x, {verdict}")
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "kv_dtype")
    parser.add_argument("--gguf", default="bundled", help="a file set (default: bundled)")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per case")
    add_case_arguments(parser, "streams:context", DEFAULT_CASES)
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    cases = args.case or [parse_case(c) for c in DEFAULT_CASES]
    torch.set_num_threads(args.threads)
    path = resolve_gguf(args.gguf)
    loaded = load_model("bundled" if args.gguf == "bundled" else str(path))
    most = max(streams * (context + args.tokens + 1) for streams, context in cases)
    engines = {name: _engine(loaded, name, most, args.threads) for name in SIDES}
    shape = engines["float32"].shape
    result: dict[str, Any] = {
        "file": path.name,
        "engine": engines["float32"].model.describe(),
        "tokens": args.tokens,
        "kv_bytes_per_token": {
            name: bytes_per_block(shape, 1, engine.kv_dtype) for name, engine in engines.items()
        },
        "goal": str(GOAL),
        "cases": {},
    }
    for streams, context in cases:
        result["cases"][f"{streams}:{context}"] = measure_case(engines, streams, context, args)
        result_file.write(result, complete=False)
    result_file.write(result)


if __name__ == "__main__":
    main()
