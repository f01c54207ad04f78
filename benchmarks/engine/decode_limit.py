"""Single-stream decode against this machine's memory limit, beside llama.cpp, in one run.

    python -m benchmarks.engine.decode_limit --gguf 1b-q4_k_m   # -> results/decode_limit.json
    python -m benchmarks.engine.decode_limit --scratch --gguf bundled --rounds 2 --tokens 16

A decode step of one stream reads every weight it multiplies once: each layer's matrices and the
LM head (the token embedding table when the file ties them), so ``bytes_per_token`` is the sum
of those tensors' bytes in the file (one embedding row, the norms and the KV are left out: they
are far smaller). No engine decodes faster than ``copy bandwidth / bytes_per_token`` tokens a
second, the physical limit, with the bandwidth the machine reads at: a ``--buffer-mb`` float32
buffer summed with ``--threads`` threads. The copy bandwidth (the same buffer copied, counted as
STREAM's Copy counts it: bytes read plus bytes written) is the second, lower yardstick. Each
round measures, back to back in rotating order (``benchmarks.harness.rounds``): both bandwidths,
pdserve's single-stream decode (a fresh random prompt of ``--prompt-tokens``, ``--tokens`` new
tokens; decode rows on float32 and on 8-bit activations, ``--activation-dtype``) and llama.cpp's
(``llama-bench`` tg<tokens>, same file and threads). Each engine's share of a limit is its rate
over that limit in the same round; the figure the note states, not a goal.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from benchmarks.engine.measures import PromptDraw, pdserve_decode_rate
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds
from benchmarks.harness.stats import spread
from benchmarks.llamacpp.build import ensure_tools
from benchmarks.llamacpp.gguf_sets import resolve_gguf
from benchmarks.llamacpp.vs_llamacpp import LlamaCpp
from engine.config import EngineConfig
from engine.kernels import set_activation_dtype
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model

EMBEDDING, HEAD = "token_embd.weight", "output.weight"
# pdserve's sides by --activation-dtype: decode rows on float32 or 8-bit activations
ACTIVATIONS = {"both": ("float32", "int8"), "float32": ("float32",), "int8": ("int8",)}


def bytes_per_token(path: Path) -> int:
    """Bytes of the tensors a one-stream decode step reads whole: every 2-D tensor but the token
    embedding, which counts only where it is also the LM head (no ``output.weight``)."""
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors if len(t.shape) == 2}
    matrices = sum(n for name, n in tensors.items() if name != EMBEDDING)
    return matrices + (tensors.get(EMBEDDING, 0) if HEAD not in tensors else 0)


def copy_bandwidth(buffer_mb: int, repeats: int = 5) -> float:
    """Bytes moved per second copying a ``buffer_mb`` buffer, counted as STREAM's Copy counts
    them (each byte read and each byte written), best of ``repeats``."""
    source = torch.ones(buffer_mb << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: target.copy_(source), repeats)
    return 2 * source.numel() / seconds


def read_bandwidth(buffer_mb: int, repeats: int = 5) -> float:
    """Bytes read per second summing a ``buffer_mb`` buffer of float32 (nothing written back
    but the sum: what a decode step does with its weights), best of ``repeats``."""
    source = torch.ones((buffer_mb << 20) // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: source.sum(), repeats)
    return 4 * source.numel() / seconds


def _best_seconds(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    path = resolve_gguf(args.gguf)
    loaded = load_model("bundled" if args.gguf == "bundled" else str(path))
    engine = LLMEngine(EngineConfig(device="cpu", num_threads=args.threads), loaded)
    llama = LlamaCpp(args.llama_cpp_dir or ensure_tools(), path, args.threads)
    draw = PromptDraw(args.seed, engine.shape.vocab_size)

    def pdserve(activation_dtype: str) -> Callable[[], float]:
        def rate() -> float:
            set_activation_dtype(activation_dtype)  # one choice per process: set before each
            return pdserve_decode_rate(engine, draw.prompt(args.prompt_tokens), args.tokens + 1)

        return rate

    engines: dict[str, Callable[[], float]] = {
        f"pdserve {dtype}": pdserve(dtype) for dtype in ACTIVATIONS[args.activation_dtype]
    }
    engines["llama.cpp"] = lambda: llama.bench(0, args.tokens)
    sides = {
        "copy": lambda: copy_bandwidth(args.buffer_mb),
        "read": lambda: read_bandwidth(args.buffer_mb),
        **engines,
    }

    def progress(index: int, values: dict[str, float]) -> None:
        rates = ", ".join(f"{side} {values[side]:.2f} tokens/s" for side in engines)
        print(
            f"round {index + 1}: copy {values['copy'] / 1e9:.2f} GB/s, read "
            f"{values['read'] / 1e9:.2f} GB/s, {rates}",
            flush=True,
        )

    kept = paired_rounds(sides, args.rounds, on_round=progress)
    per_token = bytes_per_token(path)
    limits = {kind: [b / per_token for b in kept[kind]] for kind in ("copy", "read")}
    result: dict[str, Any] = {
        "file": path.name,
        "engine": engine.model.describe(),
        "threads": args.threads,
        "tokens": args.tokens,
        "bytes_per_token": per_token,
        "gb_per_s": {kind: spread([b / 1e9 for b in kept[kind]], 2) for kind in limits},
        "limit_tokens_per_s": {kind: spread(values, 2) for kind, values in limits.items()},
        "llamacpp_build": llama.build,
    }
    result["engines"] = {}
    for side in engines:
        entry: dict[str, Any] = {"tokens_per_s": spread(kept[side], 2), "share_of_limit": {}}
        for kind, values in limits.items():
            shares = [rate / limit for rate, limit in zip(kept[side], values, strict=True)]
            entry["share_of_limit"][kind] = spread(shares, 6)
        result["engines"][side] = entry
    set_activation_dtype("float32")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "decode_limit")
    parser.add_argument("--gguf", default="1b-q4_k_m", help="a file set (default: 1b-q4_k_m)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode run")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--buffer-mb", type=int, default=1024, help="the copied buffer")
    parser.add_argument(
        "--activation-dtype", default="both", choices=ACTIVATIONS, help="pdserve's decode rows"
    )
    parser.add_argument(
        "--llama-cpp-dir", type=Path, help="a folder holding llama-bench (default: built here)"
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5, help="seed of the random prompts")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    torch.set_num_threads(args.threads)
    result = measure(args)
    for side, entry in result["engines"].items():
        shares = entry["share_of_limit"]
        print(
            f"{side}: {shares['read']['median']:.1%} of the read limit, "
            f"{shares['copy']['median']:.1%} of the copy limit",
            flush=True,
        )
    result_file.write(result)


if __name__ == "__main__":
    main()
