"""Speculative decoding against decoding without it, side by side in one run, on the engine.

    python -m benchmarks.engine.speculation          # -> benchmarks/results/speculation.json
    python -m benchmarks.engine.speculation --scratch --streams 1 --tokens 16 --rounds 2  # quick

Three engines on the same loaded file: ``off`` (the default: no drafts, not batch invariant),
``invariant`` (no drafts, batch invariant: what speculating costs before any draft) and ``ngram``
(``speculative_method: ngram``, its defaults). Two workloads, each a set of chat prompts drawn by
``--seed`` from the passages of the text the repository holds (``data/accuracy_text.txt``):

- ``grounded``: answers that quote their input (copy a passage, rewrite it keeping every
  sentence, quote its sentences about one subject, put it into a JSON object);
- ``free``: stories, explanations and lists on a topic, with nothing to quote.

Each case (a workload, a number of streams) runs ``max(streams, PROMPTS_AT_LEAST)`` prompts through
each engine once per round, ``streams`` at a time (one at a time for a single stream: several
prompts, so that one prompt's luck does not decide it), ``--tokens`` new tokens each (EOS
ignored, so every side makes the same number of tokens), the sides back to back in a rotating
order (``benchmarks.harness.rounds``). A round's figure is output tokens per second over the
whole generation (prompts included, alike on every side; the prefix cache serves them from the
second round on). ``ngram / off`` is judged against
the goal of its case (``GOALS``); ``invariant / off`` is reported. Every round checks that
``ngram``'s tokens are ``invariant``'s, token for token, and stops the run if not.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds, ratio_rounds
from benchmarks.harness.stats import Goal, judge, spread
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("data") / "accuracy_text.txt"
SIDES = ("off", "invariant", "ngram")
GROUNDED_TASKS = (
    "Copy the following passage exactly, word for word.\n\n{passage}",
    "Rewrite the following passage for a newsletter, keeping every sentence as it is.\n\n{passage}",
    "Quote, word for word, the sentences of this passage that mention a date, a number or a "
    "name.\n\n{passage}",
    'Put this passage into a JSON object of the form {{"title": ..., "text": ...}}, where text '
    "is the passage itself.\n\n{passage}",
)
FREE_TASKS = (
    "Write a short story about {topic}.",
    "Explain to a child how {topic} works.",
    "List ten facts about {topic}, one per line.",
    "Write a letter to a friend about {topic}.",
)
TOPICS = ("a lighthouse", "the moon", "bread", "trains", "a garden", "rain", "a city", "bees")
# (workload, streams) -> the goal of ngram / off; cases not listed are reported, not judged
GOALS = {
    ("grounded", 1): Goal(1.8),
    ("free", 1): Goal(0.97),
    ("grounded", 32): Goal(0.97),
    ("free", 32): Goal(0.97),
}
DEFAULT_STREAMS = (1, 8, 32)
PROMPTS_AT_LEAST = 4


def passages() -> list[str]:
    return [p.strip() for p in TEXT.read_text().split("\n\n") if len(p.split()) >= 40]


def prompts_of(workload: str, count: int, seed: int) -> list[str]:
    """``count`` prompts of ``workload``: its tasks in turn, each on a passage (a topic) drawn
    by ``seed``."""
    rng = random.Random(f"{seed}/{workload}/{count}")
    if workload == "grounded":
        texts = passages()
        return [
            GROUNDED_TASKS[i % len(GROUNDED_TASKS)].format(passage=rng.choice(texts))
            for i in range(count)
        ]
    return [FREE_TASKS[i % len(FREE_TASKS)].format(topic=rng.choice(TOPICS)) for i in range(count)]


def engines_for(loaded: Any, threads: int) -> dict[str, LLMEngine]:
    configs = {
        "off": EngineConfig(device="cpu", num_threads=threads),
        "invariant": EngineConfig(device="cpu", num_threads=threads, batch_invariant=True),
        "ngram": EngineConfig(
            device="cpu", num_threads=threads, speculative=SpeculativeConfig(method="ngram")
        ),
    }
    return {name: LLMEngine(config, loaded) for name, config in configs.items()}


def measure_case(
    engines: dict[str, LLMEngine], workload: str, streams: int, args: argparse.Namespace
) -> dict[str, Any]:
    tokenizer = engines["off"].tokenizer
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in prompts_of(workload, max(streams, PROMPTS_AT_LEAST), args.seed)
    ]
    prompts = [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    speculator = engines["ngram"].speculator
    assert speculator is not None
    stats = speculator.stats
    before = (stats.checks, stats.drafted, stats.accepted)

    def side(name: str) -> float:
        start, outputs[name] = time.perf_counter(), []
        for wave in range(0, len(prompts), streams):
            outputs[name] += engines[name].generate(prompts[wave : wave + streams], params)
        return len(prompts) * args.tokens / (time.perf_counter() - start)

    def on_round(index: int, values: dict[str, float]) -> None:
        if outputs["ngram"] != outputs["invariant"]:
            raise RuntimeError(f"{workload}:{streams}: speculative tokens differ from invariant's")
        shown = ", ".join(f"{n} {v:.1f}" for n, v in values.items())
        print(f"{workload}:{streams} round {index + 1}: tokens/s {shown}", flush=True)

    kept = paired_rounds({name: (lambda n=name: side(n)) for name in SIDES}, args.rounds,
                         on_round=on_round)  # fmt: skip
    now = (stats.checks, stats.drafted, stats.accepted)
    checks, drafted, accepted = (a - b for a, b in zip(now, before, strict=True))
    entry: dict[str, Any] = {
        "tokens_per_s": {name: spread(values, 1) for name, values in kept.items()},
        "invariant_ratio": spread(ratio_rounds(kept, "invariant", "off"), 3),
        "speculative_ratio": spread(ratio_rounds(kept, "ngram", "off"), 3),
        "token_identical": True,  # every round checked it (on_round)
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "tokens_per_check": round((accepted + checks) / checks, 2) if checks else None,
    }
    goal = GOALS.get((workload, streams))
    if goal is not None:
        verdict = judge(ratio_rounds(kept, "ngram", "off"), goal)
        entry["goal"], entry["verdict"] = str(goal), verdict.verdict
    print(f"{workload}:{streams}: ngram/off {entry['speculative_ratio']['median']}x "
          f"{entry.get('verdict', '')}", flush=True)  # fmt: skip
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "speculation")
    parser.add_argument("--gguf", default="bundled", help="a file set (default: bundled)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    parser.add_argument("--streams", type=int, action="append", help=f"{DEFAULT_STREAMS}")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=11, help="draws the prompts (held out)")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    torch.set_num_threads(args.threads)
    path = resolve_gguf(args.gguf)
    loaded = load_model("bundled" if args.gguf == "bundled" else str(path))
    engines = engines_for(loaded, args.threads)
    result: dict[str, Any] = {
        "file": path.name,
        "engine": engines["ngram"].model.describe(),
        "speculative": vars(engines["ngram"].config.speculative),
        "tokens": args.tokens,
        "seed": args.seed,
        "cases": {},
    }
    for workload in ("grounded", "free"):
        for streams in args.streams or DEFAULT_STREAMS:
            entry = measure_case(engines, workload, streams, args)
            result["cases"][f"{workload}:{streams}"] = entry
            result_file.write(result, complete=False)
    result_file.write(result)


if __name__ == "__main__":
    main()
