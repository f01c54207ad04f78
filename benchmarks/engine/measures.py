"""What the engine benchmarks measure on pdserve's side: prompts no cache has seen, and the
decode, batch and prefill rates of an :class:`LLMEngine` (``vs_transformers`` and ``vs_llamacpp``
put a peer beside each)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PREFILL_REPEATS = 3  # forwards per round and side for the prefill measure


class PromptDraw:
    """Prompts of random tokens, new at every call (from one seeded stream): no prompt repeats,
    so no measure is served from a prefix cache. Ids from 100 up to ``vocab_size`` (at most
    40,000: ordinary tokens of every vocabulary the benchmarks run)."""

    def __init__(self, seed: int, vocab_size: int = 40000) -> None:
        self.rng = random.Random(seed)
        self.high = min(vocab_size, 40000)

    def prompts(self, count: int, low: int, high: int) -> list[list[int]]:
        return [self.prompt(self.rng.randrange(low, high + 1)) for _ in range(count)]

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(min(100, self.high // 2), self.high) for _ in range(length)]


def prefix_cache_hits(engine: LLMEngine) -> int:
    """Prompt tokens the engine found in its prefix cache so far (a counter)."""
    return engine.stats().prefix_cache_hits


def pdserve_decode_rate(engine: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_request(engine.request(f"single-{id(prompt)}", prompt, params))
    times = []
    while engine.has_work():
        times += [e.emitted_at for e in engine.step() if e.token_id is not None]
    return (len(times) - 1) / (times[-1] - times[0])


def pdserve_batch_rate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return sum(map(len, outputs)) / (time.perf_counter() - start)


def first_token_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from queueing ``prompt`` to its first token (its forward, nothing else queued)."""
    start = time.perf_counter()
    one_token = SamplingParams(max_new_tokens=1)
    engine.add_request(engine.request(f"prefill-{id(prompt)}-{start}", prompt, one_token))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def pdserve_prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens/s over ``prompts`` (each new to the engine), one after another."""
    seconds = sum(first_token_seconds(engine, prompt) for prompt in prompts)
    return sum(map(len, prompts)) / seconds


def pdserve_cached_prefill_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    """Prompt tokens/s of each prompt's second sending (the first one, untimed, fills the
    prefix cache): what caching gives a repeated prompt, not what prefill computes."""
    seconds = 0.0
    for prompt in prompts:
        first_token_seconds(engine, prompt)
        seconds += first_token_seconds(engine, prompt)
    return sum(map(len, prompts)) / seconds


class SharedDraw:
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


def row(key: str, entry: dict, baseline: str) -> str:
    """One progress line: each side's median [min-max] and the ratio's median [interval]."""

    def cell(spread: dict, digits: int, low: str = "min", high: str = "max") -> str:
        return f"{spread['median']:.{digits}f} [{spread[low]:.{digits}f}-{spread[high]:.{digits}f}]"

    return (
        f"{key:<18}{cell(entry['pdserve'], 1):>26}{cell(entry[baseline], 1):>26}"
        f"{cell(entry['ratio'], 2, 'low', 'high'):>20}"
    )
