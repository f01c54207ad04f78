"""Engine throughput: pdserve's engine against transformers on the same machine, side by side.

    python -m benchmarks.engine.vs_transformers --out results/engine.json
    python -m benchmarks.engine.vs_transformers --out /tmp/engine.json --rounds 2 --new-tokens 4 \\
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

Every measure computes prompts neither engine has seen: each round (and each prefill repeat)
draws fresh random tokens, the two sides of a round the same ones, so pdserve's prefix cache (on
by default) finds nothing, and each of the batch's sequences has a prompt of its own; the JSON
records each measure's ``prefix_cache_hit_tokens`` (0, or the run stops). pdserve's weights are
the GGUF's 4- and 8-bit blocks, transformers' fp32: the ratio is what the engine gains with them,
not a like-for-like kernel comparison. Both sides run in one process, with the same ``--threads``
torch threads, greedy. Each measure runs ``--rounds`` rounds; the two sides alternate which goes
first from round to round; the first round is a warm-up for both and is dropped. The JSON holds,
for every measure, each side's rates per round and their median, min and max, and the same for
the ratio pdserve / transformers taken within each round (the two sides of a round saw the same
machine). Ratios are what to compare, since absolute rates move with whatever else the machine
is doing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from benchmarks.harness.provenance import run_meta
from engine.config import WEIGHT_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

PREFILL_REPEATS = 3  # forwards per round and side for the prefill measure


class PromptDraw:
    """Prompts of random tokens, new at every call (from one seeded stream): no prompt repeats,
    so no measure is served from a prefix cache."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def prompts(self, count: int, low: int, high: int) -> list[list[int]]:
        return [self.prompt(self.rng.randrange(low, high + 1)) for _ in range(count)]

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(length)]


def prefix_cache_hits(engine: LLMEngine) -> int:
    """Prompt tokens the engine found in its prefix cache so far (a counter)."""
    return engine.stats().prefix_cache_hits


def pdserve_decode_rate(engine: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request(f"single-{id(prompt)}", prompt, params)
    times = []
    while engine.has_work():
        times += [e.emitted_at for e in engine.step() if e.token_id is not None]
    return (len(times) - 1) / (times[-1] - times[0])


def hf_decode_rate(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    return (new_tokens - 1) / (timed(new_tokens) - timed(1))  # first token to last, as above


def pdserve_batch_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return sum(map(len, outputs)) / (time.perf_counter() - start)


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


def _first_token(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from queueing ``prompt`` to its first token (its forward, nothing else queued)."""
    start = time.perf_counter()
    engine.add_request(f"prefill-{id(prompt)}-{start}", prompt, SamplingParams(max_new_tokens=1))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def pdserve_prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens/s over ``prompts`` (each new to the engine), one after another."""
    seconds = sum(_first_token(engine, prompt) for prompt in prompts)
    return sum(map(len, prompts)) / seconds


def pdserve_cached_prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens/s of each prompt's second sending (the first one, untimed, fills the
    prefix cache): what caching gives a repeated prompt, not what prefill computes."""
    seconds = 0.0
    for prompt in prompts:
        _first_token(engine, prompt)
        seconds += _first_token(engine, prompt)
    return sum(map(len, prompts)) / seconds


@torch.inference_mode()
def hf_prefill_rate(model, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        model(torch.tensor([prompt]), logits_to_keep=1).logits[:, -1].argmax(-1)
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def _spread(values: list[float], digits: int) -> dict:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "rounds": [round(v, digits) for v in values],
    }


def compare(
    ours: Callable[[], float],
    theirs: Callable[[], float],
    rounds: int,
    baseline: str = "baseline",
) -> dict:
    """``rounds`` rounds, the first dropped; the side that goes first alternates. The other
    side's rates are kept under ``baseline``."""
    kept: list[tuple[float, float]] = []
    for index in range(rounds):
        if index % 2 == 0:
            ours_rate, theirs_rate = ours(), theirs()
        else:
            theirs_rate, ours_rate = theirs(), ours()
        if index > 0:
            kept.append((ours_rate, theirs_rate))
    return {
        "pdserve": _spread([a for a, _ in kept], 2),
        baseline: _spread([b for _, b in kept], 2),
        "ratio": _spread([a / b for a, b in kept], 3),
    }


def _row(key: str, entry: dict, baseline: str = "baseline") -> str:
    def cell(spread: dict, digits: int) -> str:
        low, high = spread["min"], spread["max"]
        return f"{spread['median']:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"

    return (
        f"{key:<15}{cell(entry['pdserve'], 1):>26}{cell(entry[baseline], 1):>26}"
        f"{cell(entry['ratio'], 2):>20}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per measure, first dropped")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    parser.add_argument(
        "--weight-dtype",
        default="auto",
        choices=WEIGHT_DTYPES,
        help="pdserve's weights (auto: the GGUF's own Q4_1/Q8_0 blocks); transformers: fp32",
    )
    args = parser.parse_args()
    if args.rounds < 2 or args.new_tokens < 2:
        parser.error("--rounds and --new-tokens must be at least 2")
    torch.set_num_threads(args.threads)
    loaded = load_model("bundled")
    config = EngineConfig(device="cpu", dtype="float32", weight_dtype=args.weight_dtype)
    engine = LLMEngine(config, loaded)
    print(f"pdserve {engine.model.describe()}; transformers fp32")
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    pad_id = loaded.tokenizer.pad_token_id or 0
    new = args.new_tokens

    draw = PromptDraw(args.seed)
    size = args.prefill_tokens
    # each side of a round gets the same fresh prompts: the round's draw is kept for the second
    single, batch, long_prompts = (
        _Shared(lambda: draw.prompt(64)),
        _Shared(lambda: draw.prompts(args.batch, 16, 256)),
        _Shared(lambda: draw.prompts(PREFILL_REPEATS, size, size)),
    )
    pairs = {
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
    results: dict[str, dict] = {}
    print(f"{'tokens/s':<15}{'pdserve':>26}{'transformers':>26}{'ratio':>20}  weights")
    for key, (ours, theirs) in pairs.items():
        hits = prefix_cache_hits(engine)
        results[key] = compare(ours, theirs, args.rounds)
        results[key]["prefix_cache_hit_tokens"] = uncached(engine, hits, key)
        print(_row(key, results[key]) + f"  {args.weight_dtype}")
    results["_meta"] = {
        **run_meta(),
        "sides": {
            "pdserve": f"{engine.model.describe()}, fp32 activations",
            "transformers": "fp32 weights and activations",
        },
        "prompts": f"random tokens, a fresh draw per round and repeat (seed {args.seed})",
        "model": loaded.name,
        "dtype": "float32",
        "weight_dtype": args.weight_dtype,
        "weights": engine.model.describe(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "new_tokens": new,
        "rounds": args.rounds,
        "dropped_rounds": 1,
        "order": "alternating, pdserve first in the dropped round",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


class _Shared:
    """``draw()`` anew at every ``share``-th call: the ``share`` sides of a round that compute
    prompts get the same ones, and no round reuses another's (``share=1``: a new draw each call)."""

    def __init__(self, draw: Callable[[], list], share: int = 2) -> None:
        self.draw, self.share, self.calls, self.value = draw, share, 0, None

    def __call__(self) -> Any:
        if self.calls % self.share == 0:
            self.value = self.draw()
        self.calls += 1
        return self.value


def uncached(engine: LLMEngine, hits_before: int, measure: str) -> int:
    """The prefix-cache hits since ``hits_before``; a measure of compute must have none."""
    hits = prefix_cache_hits(engine) - hits_before
    if hits and not measure.endswith("_cached"):
        raise RuntimeError(f"{measure} was served {hits} prompt tokens from the prefix cache")
    return hits


if __name__ == "__main__":
    main()
