"""A burst of prompts reaching an idle engine: computed in steps bounded by
``prompt_step_target_ms`` (its default) against all in one step (``0``), side by side.

    python -m benchmarks.engine.prompt_steps [--prompts 32] [--prompt-tokens 100] [--scratch]

Two engines on one loaded model, identical but for that setting, run on one core and thread (a
prefill worker's), and each round gives both the same burst: ``--prompts`` fresh random prompts
of ``--prompt-tokens`` tokens added at once, one token each (every step of a prefill worker is
such a step). Rounds are paired and interleaved (``benchmarks.harness.rounds.order_of``, the
first ``--warmup`` dropped); each keeps, per side, the burst's TTFT p50 (from the burst's
arrival to a prompt's first token) and the seconds until the last first token, and the ratios
bounded / one step of both, with their bootstrap intervals and verdicts: the bound must bring
the median prompt's first token sooner (``TTFT_GOAL``) at no real cost to the burst
(``TIME_GOAL``).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, order_of, ratio_rounds
from benchmarks.harness.stats import Goal, judge, percentile, spread
from engine.config import EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

SIDES = ("bounded", "one_step")
TTFT_GOAL = Goal(0.75, at_least=False)  # bounded / one step, the burst's TTFT p50
TIME_GOAL = Goal(1.05, at_least=False)  # bounded / one step, the burst's seconds


def engines(model: str) -> dict[str, LLMEngine]:
    """The two sides: the shipping ``prompt_step_target_ms`` and ``0``, one thread each."""
    loaded = load_model(model)
    base = EngineConfig(model_path=model, device="cpu", num_threads=1)
    base = replace(base, cache=replace(base.cache, enable_prefix_caching=False))
    one_step = replace(base, scheduler=replace(base.scheduler, prompt_step_target_ms=0))
    return {"bounded": LLMEngine(base, loaded), "one_step": LLMEngine(one_step, loaded)}


def burst(engine: LLMEngine, prompts: list[list[int]], tag: str) -> tuple[float, float]:
    """``prompts`` added at once, one token each: (TTFT p50, seconds to the last first token)."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.request(f"{tag}-{i}", prompt, params))
    firsts: list[float] = []
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter() - start
        firsts += [now for event in events if event.token_id is not None]
    if len(firsts) != len(prompts):
        raise RuntimeError(f"{len(firsts)} first tokens for {len(prompts)} prompts")
    return percentile(firsts, 50), max(firsts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="dropped rounds")
    add_output_arguments(parser, "prompt_steps")
    args = parser.parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.rounds) < 1 or args.warmup < 0:
        parser.error("--prompts, --prompt-tokens and --rounds must be >= 1, --warmup >= 0")
    result = ResultFile.start(args, argv)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sides = engines(args.model)
    draw = PromptDraw(11, sides["bounded"].shape.vocab_size)
    kept: dict[str, dict[str, list[float]]] = {s: {"ttft_p50_s": [], "burst_s": []} for s in SIDES}
    for index in range(args.warmup + args.rounds):
        prompts = draw.prompts(args.prompts, args.prompt_tokens, args.prompt_tokens)
        measured = {s: burst(sides[s], prompts, f"{index}{s}") for s in order_of([*SIDES], index)}
        cells = [f"{s} TTFT p50 {a:.2f} s, burst {b:.2f} s" for s, (a, b) in measured.items()]
        line = "  ".join(cells)
        print(f"round {index - args.warmup}: {line}", flush=True)
        if index >= args.warmup:
            for side, (ttft, seconds) in measured.items():
                kept[side]["ttft_p50_s"].append(ttft)
                kept[side]["burst_s"].append(seconds)
    result.write(summary(args, kept))
    print(f"results: {result.path}")


def summary(args: argparse.Namespace, kept: dict[str, dict[str, list[float]]]) -> dict:
    """Each side's figures, and each ratio bounded / one step with its goal and verdict."""
    data: dict = {
        "_meta": {
            "model": args.model,
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "rounds": args.rounds,
            "dropped_rounds": args.warmup,
            "threads": 1,
            "prompt_step_target_ms": SchedulerConfig.prompt_step_target_ms,
        },
        "sides": {s: {k: spread(v, 3) for k, v in kept[s].items()} for s in SIDES},
        "ratios": {},
    }
    for figure, goal in (("ttft_p50_s", TTFT_GOAL), ("burst_s", TIME_GOAL)):
        rounds = ratio_rounds({s: kept[s][figure] for s in SIDES}, "bounded", "one_step")
        verdict = judge(rounds, goal)
        data["ratios"][figure] = spread(rounds, 3) | {
            "goal": str(goal),
            "verdict": verdict.verdict,
            "judgement": str(verdict),
        }
    return data


if __name__ == "__main__":
    main()
