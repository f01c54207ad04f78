"""pdserve's engine against llama.cpp on the same GGUF, the same threads, side by side in one run.

    python benchmarks/bench_vs_llamacpp.py --out results/vs_llamacpp.json
    python benchmarks/bench_vs_llamacpp.py --out /tmp/v.json --rounds 2 --new-tokens 8 \\
        --batch 2 --prefill-tokens 32        # a quick check that it runs

llama.cpp is built once into the cache folder from the tree inside PyPI's ``llama-cpp-python``
sdist (``benchmarks/llamacpp_build.py``, about 8 minutes on two cores), or taken from
``--llama-cpp-dir`` (a folder holding ``llama-bench`` and ``llama-batched-bench``).

Three measures on the bundled SmolLM2-135M Q4_1 GGUF, pdserve with ``weight_dtype`` as given
(default ``auto``: the file's own blocks):
  single_stream  decode tokens/s of one sequence, first token to last, ``--new-tokens`` tokens;
                 llama.cpp: ``llama-bench`` tg<new-tokens> (it starts from an empty context,
                 pdserve from a 64-token prompt: a few more keys to attend to on pdserve's side)
  prefill512     prompt tokens/s of one ``--prefill-tokens`` prompt up to its first token;
                 llama.cpp: ``llama-bench`` pp<prefill-tokens>
  batch32        ``--batch`` sequences of ``--batch-prompt`` random tokens, ``--new-tokens`` new
                 tokens each, all at once: new tokens over the whole run's time (prefill
                 included); llama.cpp: ``llama-batched-bench`` (the same shape, one
                 ``llama_decode`` per step for all sequences), B·TG / T

llama.cpp samples nothing in these tools (they decode a fixed token); pdserve samples greedily,
so its figures include sampling. Each of ``--rounds`` rounds runs every measure on both sides,
alternating which side goes first; the first round is a warm-up and is dropped. The JSON keeps
each side's rates per round with median, min and max, and the ratio pdserve / llama.cpp taken
within each round. Run it on an idle machine: llama.cpp's threads spin, and lose several times
their speed when another process takes a core.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import (  # noqa: E402
    _prompts,
    _row,
    pdserve_batch_rate,
    pdserve_decode_rate,
    pdserve_prefill_rate,
)
from benchmarks.bench_engine import compare as engine_compare  # noqa: E402
from benchmarks.llamacpp_build import TOOLS, ensure_tools, has_tools  # noqa: E402
from engine.config import WEIGHT_DTYPES, EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.loader import load_model  # noqa: E402


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


def compare(ours: Callable[[], float], theirs: Callable[[], float], rounds: int) -> dict:
    """``bench_engine.compare`` with llama.cpp's rates under ``llamacpp``."""
    return engine_compare(ours, theirs, rounds, baseline="llamacpp")


def _llama_cpp_folder(given: Path | None) -> Path:
    if given is None:
        return ensure_tools()
    if not has_tools(given):
        raise SystemExit(f"--llama-cpp-dir {given} must hold {' and '.join(TOOLS)}")
    return given


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--llama-cpp-dir", type=Path, help="prebuilt llama.cpp tools (else built)")
    parser.add_argument("--threads", type=int, default=2, help="threads, both sides")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batch-prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per measure, first dropped")
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES)
    args = parser.parse_args()
    if args.rounds < 2 or args.new_tokens < 2:
        parser.error("--rounds and --new-tokens must be at least 2")

    llama = LlamaCpp(_llama_cpp_folder(args.llama_cpp_dir), Path(), args.threads)
    torch.set_num_threads(args.threads)
    loaded = load_model("bundled")
    if loaded.gguf_path is None:
        raise SystemExit("the bundled model has no GGUF to hand llama.cpp")
    llama.gguf = loaded.gguf_path
    engine = LLMEngine(EngineConfig(device="cpu", weight_dtype=args.weight_dtype), loaded)
    print(f"pdserve {engine.model.describe()}; llama.cpp {llama.folder}")

    new = args.new_tokens
    single = _prompts(1, 64, 64, seed=1)[0]
    long_prompt = _prompts(1, args.prefill_tokens, args.prefill_tokens, seed=3)[0]
    batch = _prompts(args.batch, args.batch_prompt, args.batch_prompt, seed=2)
    pairs = {
        "single_stream": (
            lambda: pdserve_decode_rate(engine, single, new),
            lambda: llama.bench(0, new),
        ),
        f"prefill{args.prefill_tokens}": (
            lambda: pdserve_prefill_rate(engine, long_prompt),
            lambda: llama.bench(args.prefill_tokens, 0),
        ),
        f"batch{args.batch}": (
            lambda: pdserve_batch_rate(engine, batch, new),
            lambda: llama.batched(args.batch, args.batch_prompt, new),
        ),
    }
    results: dict[str, dict] = {}
    print(f"{'tokens/s':<15}{'pdserve':>26}{'llama.cpp':>26}{'ratio':>20}")
    for key, (ours, theirs) in pairs.items():
        results[key] = compare(ours, theirs, args.rounds)
        print(_row(key, results[key], baseline="llamacpp"), flush=True)
    results["_meta"] = {
        "model": loaded.name,
        "gguf": loaded.gguf_path.name,
        "pdserve_weights": engine.model.describe(),
        "llamacpp": llama.build,
        "threads": args.threads,
        "new_tokens": new,
        "batch_prompt_tokens": args.batch_prompt,
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
