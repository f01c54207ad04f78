"""Engine throughput: pdserve's engine against transformers on the same machine, side by side.

    python benchmarks/bench_engine.py --out results/engine.json
    python benchmarks/bench_engine.py --out /tmp/engine.json --rounds 2 --new-tokens 4 \\
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

Both sides get the same treatment: one process, the same ``--threads`` torch threads, greedy, the
same prompts. Each measure runs ``--rounds`` rounds; the two sides alternate which goes first from
round to round; the first round is a warm-up for both and is dropped. The JSON holds, for every
measure, each side's rates per round and their median, min and max, and the same for the ratio
pdserve / transformers taken within each round (the two sides of a round saw the same machine).
Ratios are what to compare, since absolute rates move with whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config import WEIGHT_DTYPES, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

PREFILL_REPEATS = 3  # forwards per round and side for the prefill measure


def _prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(rng.randrange(low, high + 1))]
        for _ in range(count)
    ]


def pdserve_decode_rate(engine: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request("single", prompt, params)
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


def pdserve_prefill_rate(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    for i in range(PREFILL_REPEATS):
        engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_new_tokens=1))
        while engine.has_work():  # one step: the prompt's forward and its first token
            engine.step()
    return PREFILL_REPEATS * len(prompt) / (time.perf_counter() - start)


@torch.inference_mode()
def hf_prefill_rate(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    for _ in range(PREFILL_REPEATS):
        model(ids, logits_to_keep=1).logits[:, -1].argmax(-1)
    return PREFILL_REPEATS * len(prompt) / (time.perf_counter() - start)


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

    single = _prompts(1, 64, 64, seed=1)[0]
    batch = _prompts(args.batch, 16, 256, seed=2)
    long_prompt = _prompts(1, args.prefill_tokens, args.prefill_tokens, seed=3)[0]
    pairs = {
        "single_stream": (
            lambda: pdserve_decode_rate(engine, single, new),
            lambda: hf_decode_rate(hf, single, new),
        ),
        f"batch{args.batch}": (
            lambda: pdserve_batch_rate(engine, batch, new),
            lambda: hf_batch_rate(hf, batch, new, pad_id),
        ),
        f"prefill{args.prefill_tokens}": (
            lambda: pdserve_prefill_rate(engine, long_prompt),
            lambda: hf_prefill_rate(hf, long_prompt),
        ),
    }
    results: dict[str, dict] = {}
    print(f"{'tokens/s':<15}{'pdserve':>26}{'transformers':>26}{'ratio':>20}  weights")
    for key, (ours, theirs) in pairs.items():
        results[key] = compare(ours, theirs, args.rounds)
        print(_row(key, results[key]) + f"  {args.weight_dtype}")
    results["_meta"] = {
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
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
