"""Engine throughput: pdserve's engine against transformers on the same machine, side by side.

    python -m benchmarks.engine.vs_transformers             # -> benchmarks/results/engine.json
    python -m benchmarks.engine.vs_transformers --scratch --rounds 2 --new-tokens 4 \\
        --batch 2 --prefill-tokens 32          # a seconds-long check that it runs

Three measurements on the bundled SmolLM2-135M (fp32 activations; pdserve's weights as
``--weight-dtype`` says, by default the GGUF's own Q4_1 / Q8_0 blocks; transformers' fp32):
  single_stream  one request, ``--new-tokens`` new tokens: decode tokens/s (first token to last)
  batch          ``--batch`` requests of mixed prompt lengths: aggregate tokens/s, against
                 transformers' static-batch ``generate`` with left padding
  prefill        prompt tokens/s for one ``--prefill-tokens`` prompt up to its first token, against
                 one transformers forward with ``logits_to_keep=1`` (what ``generate`` runs for its
                 first step: the vocabulary projection of the last position only, the KV cache
                 kept), then the argmax

Every measure computes prompts neither engine has seen: each round (and each prefill repeat) draws
fresh random tokens, the two sides of a round the same ones, so pdserve's prefix cache (on by
default) finds nothing, and each of the batch's sequences has a prompt of its own; the JSON records
each measure's ``prefix_cache_hit_tokens`` (0, or the run stops). pdserve's weights are the GGUF's
4- and 8-bit blocks, transformers' fp32: the ratio is what the engine gains with them, not a
like-for-like kernel comparison. Both sides run in one process, with the same ``--threads`` torch
threads, greedy. Each measure runs ``--rounds`` kept rounds (5 by default) after one warm-up round,
the two sides back to back in each, alternating which goes first
(:mod:`benchmarks.harness.rounds`). The JSON holds, for every measure, each side's rates per round
and their median, min and max, and the ratio pdserve / transformers taken within each round with
the bootstrap interval of its median (the two sides of a round saw the same machine). Ratios are
what to compare, since absolute rates move with whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks.engine.measures import (
    PREFILL_REPEATS,
    PromptDraw,
    SharedDraw,
    pdserve_batch_rate,
    pdserve_decode_rate,
    pdserve_prefill_rate,
    prefix_cache_hits,
    row,
    uncached,
)
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds, summarize
from engine.config import WEIGHT_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.gguf_cache import bundled_gguf_path, converted_dir_for
from engine.model.loader import load_model


class _TokenClock(BaseStreamer):
    """When ``generate`` hands over each new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode_rate(model, prompt: list[int], new_tokens: int) -> float:
    clock = _TokenClock()
    model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
    )
    tokens = clock.times[1:]  # first token to last, as pdserve's side is timed
    return (len(tokens) - 1) / (tokens[-1] - tokens[0])


def hf_batch_rate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_prefill_rate(model, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        model(torch.tensor([prompt]), logits_to_keep=1).logits[:, -1].argmax(-1)
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "engine")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    parser.add_argument(
        "--weight-dtype",
        default="auto",
        choices=WEIGHT_DTYPES,
        help="pdserve's weights (auto: the GGUF's own Q4_1/Q8_0 blocks); transformers: fp32",
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 2:
        parser.error("--rounds must be at least 1 and --new-tokens at least 2")
    result = ResultFile.start(args)
    torch.set_num_threads(args.threads)
    loaded = load_model("bundled")
    config = EngineConfig(device="cpu", dtype="float32", weight_dtype=args.weight_dtype)
    engine = LLMEngine(config, loaded)
    print(f"pdserve {engine.model.describe()}; transformers fp32")
    hf_dir = converted_dir_for(bundled_gguf_path())  # transformers' float32 image of the file
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pad_id = loaded.tokenizer.pad_token_id or 0
    pairs = _pairs(args, engine, hf, pad_id)
    results: dict[str, dict] = {"_meta": _meta(args, engine, loaded.name)}
    print(f"{'tokens/s':<18}{'pdserve':>26}{'transformers':>26}{'ratio':>20}  weights")
    for key, (ours, theirs) in pairs.items():
        hits = prefix_cache_hits(engine)
        kept = paired_rounds({"pdserve": ours, "baseline": theirs}, args.rounds)
        results[key] = summarize(kept, "pdserve", "baseline")
        results[key]["prefix_cache_hit_tokens"] = uncached(engine, hits, key)
        print(row(key, results[key], "baseline") + f"  {args.weight_dtype}", flush=True)
        result.write(results, complete=False)
    result.write(results)


def _pairs(
    args: argparse.Namespace, engine: LLMEngine, hf: Any, pad_id: int
) -> dict[str, tuple[Callable[[], float], Callable[[], float]]]:
    """Measure -> its (pdserve, transformers) sides, both on the same fresh prompts a round."""
    new, size = args.new_tokens, args.prefill_tokens
    draw = PromptDraw(args.seed)
    # each side of a round gets the same fresh prompts: the round's draw is kept for the second
    single, batch, long_prompts = (
        SharedDraw(lambda: draw.prompt(64)),
        SharedDraw(lambda: draw.prompts(args.batch, 16, 256)),
        SharedDraw(lambda: draw.prompts(PREFILL_REPEATS, size, size)),
    )
    return {
        "single_stream": (
            lambda: pdserve_decode_rate(engine, single(), new),
            lambda: hf_decode_rate(hf, single(), new),
        ),
        f"batch{args.batch}": (
            lambda: pdserve_batch_rate(engine, batch(), new),
            lambda: hf_batch_rate(hf, batch(), new, pad_id),
        ),
        f"prefill{size}": (
            lambda: pdserve_prefill_rate(engine, long_prompts()),
            lambda: hf_prefill_rate(hf, long_prompts()),
        ),
    }


def _meta(args: argparse.Namespace, engine: LLMEngine, model: str) -> dict:
    return {
        "sides": {
            "pdserve": f"{engine.model.describe()}, fp32 activations",
            "transformers": "fp32 weights and activations",
        },
        "prompts": f"random tokens, a fresh draw per round and repeat (seed {args.seed})",
        "model": model,
        "dtype": "float32",
        "weight_dtype": args.weight_dtype,
        "weights": engine.model.describe(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "dropped_rounds": 1,
        "order": "alternating within rounds (A B, B A, ...), pdserve first in the dropped round",
    }


if __name__ == "__main__":
    main()
