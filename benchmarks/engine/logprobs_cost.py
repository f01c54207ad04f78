"""What log probabilities cost a decode step: the bundled model decoding with ``logprobs`` and 5
alternatives on every row against none, side by side in paired rounds.

    python -m benchmarks.engine.logprobs_cost          # -> benchmarks/results/logprobs_cost.json
    python -m benchmarks.engine.logprobs_cost --scratch --tokens 16 --rounds 3

For each ``--streams`` count, ``--streams`` fresh prompts of 64 random tokens are prefilled, then
decoded ``--tokens`` steps; a side's figure in a round is the median decode step (its time per
output token at that batch). The ratio with / without is taken round by round and judged against
the issue's bound on the time per output token, ``<= 1.05`` (met only where the 95 % interval of
the median ratio lies under it). The coordinator's own added µs a token
(``benchmarks/serving/door_costs.py``'s ``chat_logprobs``) runs on another core: it adds to a
stream's time per token only where the coordinator is the bottleneck.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

import torch

from benchmarks.engine.measures import PromptDraw
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, DEFAULT_WARMUP, paired_rounds, summarize
from benchmarks.harness.stats import Goal, judge
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

GOAL = Goal(1.05, at_least=False)
TOP = 5
PROMPT_TOKENS = 64


def decode_step_s(engine: LLMEngine, draw: PromptDraw, streams: int, tokens: int,
                  logprobs: int) -> float:  # fmt: skip
    """The median decode step of ``streams`` fresh requests decoding ``tokens`` tokens."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, logprobs=logprobs)
    for n, prompt in enumerate(draw.prompts(streams, PROMPT_TOKENS, PROMPT_TOKENS)):
        engine.add_request(engine.request(f"lp{logprobs}-{time.monotonic_ns()}-{n}", prompt,
                                          params))  # fmt: skip
    steps = []
    while engine.requests:
        started = time.perf_counter()
        events = engine.step()
        seconds = time.perf_counter() - started
        if events and all(e.num_output_tokens > 1 for e in events if e.token_id is not None):
            steps.append(seconds)  # decode steps only (the prefill's first token excluded)
    return statistics.median(steps)


def run(engine: LLMEngine, streams_list: list[int], tokens: int, rounds: int) -> dict:
    draw = PromptDraw(seed=11)
    result = {}
    for streams in streams_list:
        sides = {
            "logprobs": partial(decode_step_s, engine, draw, streams, tokens, TOP),
            "none": partial(decode_step_s, engine, draw, streams, tokens, -1),
        }
        kept = paired_rounds(sides, rounds, DEFAULT_WARMUP)
        kept_ms = {name: [v * 1000 for v in values] for name, values in kept.items()}
        summary = summarize(kept_ms, "logprobs", "none", digits=3)
        verdict = judge(summary["ratio"]["rounds"], GOAL)
        summary["verdict"] = {"goal": str(GOAL), "verdict": verdict.verdict}
        result[str(streams)] = summary
        print(f"{streams} streams: {summary['logprobs']['median']} / {summary['none']['median']} "
              f"ms a step, ratio {summary['ratio']['median']} [{summary['ratio']['low']}-"
              f"{summary['ratio']['high']}] {verdict}", file=sys.stderr)  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="decode steps a side and round")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2)
    add_output_arguments(parser, "logprobs_cost")
    args = parser.parse_args(argv)
    result = ResultFile.start(args, argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(device="cpu"), load_model("bundled"))
    streams = [int(n) for n in args.streams.split(",")]
    batches = run(engine, streams, args.tokens, args.rounds)
    settings = {"streams": streams, "tokens": args.tokens, "rounds": args.rounds,
                "top_logprobs": TOP, "threads": args.threads}  # fmt: skip
    print(result.write({"settings": settings, "batches": batches}))


if __name__ == "__main__":
    main()
