"""pdserve's engine against llama.cpp on the same GGUF files and threads, side by side in one run.

    python -m benchmarks.llamacpp.vs_llamacpp            # -> benchmarks/results/vs_llamacpp.json
    python -m benchmarks.llamacpp.vs_llamacpp --scratch --gguf bundled --gguf bundled-q4_k_m \\
        --rounds 2 --new-tokens 8 --batch 2 --prefill-tokens 32        # a quick check that it runs
    python -m benchmarks.llamacpp.vs_llamacpp --scratch --gguf 1b-q4_k_m --batch 8

``--gguf`` (repeatable, default ``bundled``) names a file set of
``benchmarks/llamacpp/gguf_sets.py`` (``bundled``, ``bundled-q4_k_m``, ``bundled-q5_k_m``,
``bundled-q6_k``, ``bundled-q8_0``, ``1b-q4_k_m``, ``0.5b-q4_k_m``, ``3b-q4_k_m``: made once with
llama-quantize and ``benchmarks/llamacpp/random_gguf.py``) or a ``.gguf`` path. Every file runs
every measure in turn, each with its own engine.

llama.cpp is built once into the cache folder from the tree inside PyPI's ``llama-cpp-python``
sdist (``benchmarks/llamacpp/build.py``, about 8 minutes on two cores per build) for the
instruction sets this CPU executes, twice: plain (``cpu``) and with ggml's BLAS backend on
OpenBLAS (``blas``); every measure runs both and keeps the faster build as the peer. ``--builds``
picks fewer; ``--llama-cpp-dir`` takes a folder holding ``llama-bench`` and
``llama-batched-bench`` instead.

Measures on each file (``--measures`` picks some), pdserve with ``weight_dtype`` as given
(default ``auto``: the file's own blocks where its kernels have them) and ``--activation-dtype``
(``float32``, ``int8``, or ``both``: pdserve on int8 and on float32 activations as two sides of
the same rounds, the ratio taken for int8 and the float32 side's kept beside it under
``pdserve_float32``):
  single_stream     decode tokens/s of one sequence, first token to last, ``--new-tokens`` tokens
                    (default 128); llama.cpp: ``llama-bench`` tg<new-tokens> (tg128; it starts
                    from an empty context, pdserve from a 64-token prompt: a few more keys to
                    attend to on its side)
  prefill512        prompt tokens/s of ``--prefill-tokens`` prompts up to their first token, every
                    one new to the engine (fresh random tokens per repeat and round: the prefix
                    cache finds nothing); llama.cpp: ``llama-bench`` pp<prefill-tokens>
  prefill512_cached the same prompts sent a second time: what the prefix cache gives a repeat,
                    against the same pp figure (llama-bench has no cache); not a compute figure
  batch32           ``--batch`` sequences, each its own ``--batch-prompt`` random tokens (a fresh
                    draw per round), ``--batch-new-tokens`` new tokens each, all at once: new
                    tokens over the whole run's time (prefill included); ``llama-batched-bench``
                    (the same shape, one ``llama_decode`` per step for all sequences), B·TG / T

llama.cpp samples nothing in these tools (they decode a fixed token); pdserve samples greedily, so
its figures include sampling. Each measure runs one warm-up round, dropped, then ``--rounds`` kept
rounds (5 by default), every side once per round back to back, the order rotating from round to
round (:mod:`benchmarks.harness.rounds`). The JSON keeps, under ``files`` by set name, each file's
tensor types (tensors per GGML type) and shapes and, for each measure, each side's rates per round
with median, min and max, the ratio pdserve / the faster build taken within each round with the
bootstrap interval of its median, the prefix-cache hits of each measure; ``_meta`` holds each
build's CMake options and the instruction sets each side ran. Run it on an idle machine:
llama.cpp's threads spin, and lose several times their speed when another process takes a core.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine.measures import (
    PREFILL_REPEATS,
    PromptDraw,
    SharedDraw,
    pdserve_batch_rate,
    pdserve_cached_prefill_rate,
    pdserve_decode_rate,
    pdserve_prefill_rate,
    prefix_cache_hits,
    row,
    uncached,
)
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS, paired_rounds
from benchmarks.harness.stats import spread
from benchmarks.llamacpp.build import TOOLS, VARIANTS, build_options, ensure_tools, has_tools
from benchmarks.llamacpp.gguf_sets import NAMED_SETS, resolve_gguf
from benchmarks.llamacpp.requantize import tensor_type_counts
from engine.config import (
    ACTIVATION_DTYPES,
    KV_CACHE_DTYPES,
    PROMPT_MATMUL_DTYPES,
    WEIGHT_DTYPES,
    EngineConfig,
)
from engine.kernels import set_activation_dtype
from engine.kernels.isa import resolved_activation_dtype
from engine.kernels.quantized import quantized_kernels
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model


class LlamaCpp:
    """``llama-bench`` and ``llama-batched-bench`` on one GGUF with a fixed thread count."""

    def __init__(self, folder: Path, gguf: Path, threads: int) -> None:
        self.folder, self.gguf, self.threads = folder, gguf, threads
        self.build: dict = {}

    def _output(self, tool: str, *args: str) -> str:
        command = [str(self.folder / tool), "-m", str(self.gguf), "-t", str(self.threads), *args]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        return done.stdout

    def bench(self, prompt: int, generate: int) -> float:
        """tokens/s of one llama-bench test: pp<prompt> when generate is 0, else tg<generate>."""
        rows = json.loads(
            self._output(
                "llama-bench", "-p", str(prompt), "-n", str(generate), "-r", "1", "-o", "json"
            )
        )
        self.build = {key: rows[0].get(key) for key in ("build_commit", "build_number", "cpu_info")}
        return float(rows[0]["avg_ts"])

    def batched(self, sequences: int, prompt: int, generate: int) -> float:
        """New tokens/s of ``sequences`` sequences decoded together, prefill time included."""
        context = sequences * (prompt + generate) + 64
        out = self._output(
            "llama-batched-bench", "-c", str(context), "-b", "2048", "-ub", "512",
            "-npp", str(prompt), "-ntg", str(generate), "-npl", str(sequences),
            "--output-format", "jsonl",
        )  # fmt: skip
        row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
        return row["pl"] * row["tg"] / row["t"]


def compare_best(
    ours: Callable[[], float],
    builds: dict[str, Callable[[], float]],
    rounds: int,
    also: dict[str, Callable[[], float]] | None = None,
) -> dict:
    """pdserve against every llama.cpp build over ``rounds`` kept rounds (one warm-up dropped)
    whose order rotates; the peer is the build with the higher median, and ``ratio`` is taken
    within each round against that build's rate of the same round. ``also``: more sides of the
    same rounds (pdserve in another setting), each with its ratio to the peer, ``<name>_ratio``."""
    also = also or {}
    kept = paired_rounds({"pdserve": ours, **also, **builds}, rounds)
    best = max(builds, key=lambda name: statistics.median(kept[name]))
    result: dict[str, Any] = {name: spread(values, 2) for name, values in kept.items()}
    result["llamacpp"] = result[best]
    result["llamacpp_build"] = best
    for name in ("pdserve", *also):
        ratios = [a / b for a, b in zip(kept[name], kept[best], strict=True)]
        result["ratio" if name == "pdserve" else f"{name}_ratio"] = spread(ratios, 3)
    return result


def _llama_cpp_folders(given: Path | None, builds: list[str]) -> dict[str, Path]:
    if given is None:
        return {build: ensure_tools(variant=build) for build in builds}
    if not has_tools(given):
        raise SystemExit(f"--llama-cpp-dir {given} must hold {' and '.join(TOOLS)}")
    return {"given": given}


def _llama_cpp_folder(given: Path | None) -> Path:
    return next(iter(_llama_cpp_folders(given, ["cpu"]).values()))


MEASURES = ("single_stream", "prefill", "prefill_cached", "batch")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "vs_llamacpp")
    parser.add_argument(
        "--gguf", action="append", help=f"a set ({', '.join(NAMED_SETS)}) or a .gguf path; "
        "repeat for several (default: bundled)",
    )  # fmt: skip
    parser.add_argument("--llama-cpp-dir", type=Path, help="prebuilt llama.cpp tools (else built)")
    parser.add_argument(
        "--builds", default=",".join(VARIANTS), help="llama.cpp builds to run (cpu, blas)"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads, both sides")
    parser.add_argument("--new-tokens", type=int, default=128, help="single stream: tg<N>")
    parser.add_argument("--batch-new-tokens", type=int, help="per sequence (default --new-tokens)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--seed", type=int, default=3, help="seed of the random prompts")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    parser.add_argument("--prompt-matmul-dtype", default="float32", choices=PROMPT_MATMUL_DTYPES)
    parser.add_argument(
        "--activation-dtype", default="auto", choices=(*ACTIVATION_DTYPES, "both"),
        help="what decode rows multiply the weights with; both: int8 and float32 side by side",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="pdserve's KV cache (llama.cpp's stays at its default, float16)",
    )  # fmt: skip
    parser.add_argument(
        "--measures", default=",".join(MEASURES), help=f"some of {', '.join(MEASURES)}"
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    args.batch_new_tokens = args.batch_new_tokens or args.new_tokens
    if args.rounds < 1 or min(args.new_tokens, args.batch_new_tokens) < 2:
        parser.error("--rounds must be at least 1, --new-tokens and --batch-new-tokens 2")
    builds = [b for b in args.builds.split(",") if b]
    if not builds or set(builds) - set(VARIANTS):
        parser.error(f"--builds takes some of {', '.join(VARIANTS)}, got {args.builds!r}")
    measures = [m for m in args.measures.split(",") if m]
    if not measures or set(measures) - set(MEASURES):
        parser.error(f"--measures takes some of {', '.join(MEASURES)}, got {args.measures!r}")
    names = args.gguf or ["bundled"]
    if len(set(names)) != len(names):
        parser.error(f"--gguf names a file twice: {names}")

    result = ResultFile.start(args)
    torch.set_num_threads(args.threads)
    folders = _llama_cpp_folders(args.llama_cpp_dir, builds)
    files = {name: resolve_gguf(name) for name in names}  # made first (requantized, written)
    results: dict[str, Any] = {"_meta": _meta(args, folders), "files": {}}
    for name, path in files.items():
        results["files"][name] = bench_file(args, name, path, folders, results, result)
    result.write(results)


def bench_file(
    args: argparse.Namespace,
    name: str,
    path: Path,
    folders: dict[str, Path],
    results: dict,
    out: ResultFile,
) -> dict:
    """Every measure on ``path``, pdserve against each llama.cpp build; ``results`` (with this
    file's figures so far) is rewritten to ``out`` after each measure."""
    loaded = load_model("bundled" if name == "bundled" else str(path))
    llamas = {build: LlamaCpp(folder, path, args.threads) for build, folder in folders.items()}
    both = args.activation_dtype == "both"
    config = EngineConfig(
        device="cpu",
        weight_dtype=args.weight_dtype,
        prompt_matmul_dtype=args.prompt_matmul_dtype,
        activation_dtype="int8" if both else args.activation_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = LLMEngine(config, loaded)
    print(f"{name}: pdserve {engine.model.describe()}; llama.cpp {', '.join(map(str, llamas))}")
    entry: dict[str, Any] = {"file": _file_meta(args, name, path, engine), "measures": {}}
    results["files"][name] = entry
    print(f"{'tokens/s':<18}{'pdserve':>26}{'llama.cpp':>26}{'ratio':>20}  build", flush=True)
    for key, (ours, theirs) in _measures(args, engine, llamas).items():
        hits = prefix_cache_hits(engine)
        also = {"pdserve_float32": _on(ours, "float32")} if both else {}
        ours = _on(ours, "int8") if both else ours
        measured = compare_best(ours, theirs, args.rounds, also)
        measured["prefix_cache_hit_tokens"] = uncached(engine, hits, key)
        entry["measures"][key] = measured
        print(f"{row(key, measured, 'llamacpp')}  {measured['llamacpp_build']}", flush=True)
        entry["file"]["llamacpp_builds"] = {b: llama.build for b, llama in llamas.items()}
        out.write(results, complete=False)  # what is measured so far
    del engine, loaded
    gc.collect()
    return entry


def _on(measure: Callable[[], float], activation_dtype: str) -> Callable[[], float]:
    """``measure`` run with ``activation_dtype`` (one choice per process: set before each)."""

    def run() -> float:
        set_activation_dtype(activation_dtype)
        return measure()

    return run


def _measures(args: argparse.Namespace, engine: LLMEngine, llamas: dict[str, LlamaCpp]) -> dict:
    new, batch_new, size = args.new_tokens, args.batch_new_tokens, args.prefill_tokens
    draw = PromptDraw(args.seed, engine.shape.vocab_size)
    single = SharedDraw(lambda: draw.prompt(64), share=1)
    long_prompts = SharedDraw(lambda: draw.prompts(PREFILL_REPEATS, size, size), share=1)
    batch = SharedDraw(
        lambda: draw.prompts(args.batch, args.batch_prompt, args.batch_prompt), share=1
    )

    def each(measure: Callable[[LlamaCpp], float]) -> dict[str, Callable[[], float]]:
        return {build: (lambda llama=llama: measure(llama)) for build, llama in llamas.items()}

    every = {
        "single_stream": (
            "single_stream",
            lambda: pdserve_decode_rate(engine, single(), new),
            each(lambda llama: llama.bench(0, new)),
        ),
        "prefill": (
            f"prefill{size}",
            lambda: pdserve_prefill_rate(engine, long_prompts()),
            each(lambda llama: llama.bench(size, 0)),
        ),
        "prefill_cached": (
            f"prefill{size}_cached",
            lambda: pdserve_cached_prefill_rate(engine, long_prompts()),
            each(lambda llama: llama.bench(size, 0)),
        ),
        "batch": (
            f"batch{args.batch}",
            lambda: pdserve_batch_rate(engine, batch(), batch_new),
            each(lambda llama: llama.batched(args.batch, args.batch_prompt, batch_new)),
        ),
    }
    chosen = [m for m in MEASURES if m in args.measures.split(",")]
    return {every[m][0]: every[m][1:] for m in chosen}


def _file_meta(args: argparse.Namespace, name: str, path: Path, engine: LLMEngine) -> dict:
    return {
        "gguf": path.name,
        "size_bytes": path.stat().st_size,
        "tensor_types": tensor_type_counts(path),
        "pdserve_weights": engine.model.describe(),
        "new_tokens": args.new_tokens,
        "batch_new_tokens": args.batch_new_tokens,
        "batch_prompt_tokens": args.batch_prompt,
    }


def _meta(args: argparse.Namespace, folders: dict[str, Path]) -> dict:
    both = args.activation_dtype == "both"
    activations = "int8" if both else resolved_activation_dtype(args.activation_dtype)
    return {
        "sides": {
            "pdserve": {
                "kernel_isa": _pdserve_isa(),
                "threads": args.threads,
                "activation_dtype": activations,
                "kv_cache_dtype": args.kv_cache_dtype,
                **({"also": "pdserve_float32"} if both else {}),
            },
            **{
                f"llamacpp_{build}": {
                    "folder": str(folder),
                    "cmake_options": build_options(folder),
                    "threads": args.threads,
                }
                for build, folder in folders.items()
            },
        },
        "prompts": f"random tokens, a fresh draw per round and repeat (seed {args.seed})",
        "new_tokens": args.new_tokens,
        "batch_new_tokens": args.batch_new_tokens,
        "batch_prompt_tokens": args.batch_prompt,
        "rounds": args.rounds,
        "dropped_rounds": 1,
        "order": "rotating per round, pdserve first in the dropped round",
    }


def _pdserve_isa() -> str:
    module = quantized_kernels()
    return module.isa() if module is not None and hasattr(module, "isa") else "torch"


if __name__ == "__main__":
    main()
