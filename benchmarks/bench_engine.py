"""Engine throughput: pdserve's engine against transformers on the same machine, side by side.

    python benchmarks/bench_engine.py --out results/engine.json

Three measurements on the bundled SmolLM2-135M (fp32, ``--threads`` torch threads each):
  single_stream  one request, 128 new tokens: decode tokens/s (first token to last)
  batch32        32 requests of mixed prompt lengths, 128 new tokens each: aggregate tokens/s,
                 against transformers' static-batch ``generate`` with left padding
  prefill512     prompt tokens/s for one 512-token prompt, against one transformers forward
The JSON holds ``{key: {"pdserve": x, "baseline": y, "ratio": x / y}}``; ratios are what to
compare, since absolute times move with whatever else the machine is doing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams

NEW_TOKENS = 128


def _prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(rng.randrange(low, high + 1))]
        for _ in range(count)
    ]


def pdserve_decode_rate(engine: LLMEngine, prompt: list[int]) -> float:
    engine.add_request("single", prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    times = []
    while engine.has_work():
        times += [e.emitted_at for e in engine.step() if e.token_id is not None]
    return (len(times) - 1) / (times[-1] - times[0])


def hf_decode_rate(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    return (NEW_TOKENS - 1) / (timed(NEW_TOKENS) - timed(1))


def pdserve_batch_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return sum(map(len, outputs)) / (time.perf_counter() - start)


def hf_batch_rate(model, prompts: list[list[int]], pad_id: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def pdserve_prefill_rate(engine: LLMEngine, prompt: list[int], repeats: int) -> float:
    rates = []
    for i in range(repeats):
        start = time.perf_counter()
        engine.add_request(f"p{i}", prompt, SamplingParams(max_new_tokens=1))
        while engine.has_work():
            engine.step()
        rates.append(len(prompt) / (time.perf_counter() - start))
    return statistics.median(rates)


@torch.inference_mode()
def hf_prefill_rate(model, prompt: list[int], repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(torch.tensor([prompt]))
        rates.append(len(prompt) / (time.perf_counter() - start))
    return statistics.median(rates)


def _entry(ours: float, baseline: float) -> dict[str, float]:
    return {
        "pdserve": round(ours, 2),
        "baseline": round(baseline, 2),
        "ratio": round(ours / baseline, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per measure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("bundled")
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32"), loaded)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    pad_id = loaded.tokenizer.pad_token_id or 0
    warm = _prompts(1, 16, 16)[0]
    engine.generate([warm], SamplingParams(max_new_tokens=4))
    hf.generate(torch.tensor([warm]), max_new_tokens=4)

    single = _prompts(1, 64, 64, seed=1)[0]
    batch = _prompts(args.batch, 16, 256, seed=2)
    long_prompt = _prompts(1, 512, 512, seed=3)[0]
    pairs = {
        "single_stream": (
            lambda: pdserve_decode_rate(engine, single),
            lambda: hf_decode_rate(hf, single),
        ),
        f"batch{args.batch}": (
            lambda: pdserve_batch_rate(engine, batch),
            lambda: hf_batch_rate(hf, batch, pad_id),
        ),
        "prefill512": (
            lambda: pdserve_prefill_rate(engine, long_prompt, 3),
            lambda: hf_prefill_rate(hf, long_prompt, 3),
        ),
    }
    results = {}
    for key, (ours, theirs) in pairs.items():
        # Alternate the two, several rounds, and keep medians: the machine's speed drifts.
        rounds = [(ours(), theirs()) for _ in range(args.rounds)]
        results[key] = _entry(
            statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds)
        )
    print(f"{'measure':<15}{'pdserve':>12}{'transformers':>14}{'ratio':>8}")
    for key, row in results.items():
        print(f"{key:<15}{row['pdserve']:>12.1f}{row['baseline']:>14.1f}{row['ratio']:>8.2f}")
    results["_meta"] = {
        "model": loaded.name,
        "dtype": "float32",
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
