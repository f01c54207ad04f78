"""Requantize a GGUF file with llama.cpp's ``llama-quantize`` into the cache folder, once.

    python -m benchmarks.llamacpp.requantize Q4_K_M Q5_K_M Q6_K Q8_0   # the bundled model, 4 ways
    python -m benchmarks.llamacpp.requantize Q4_K_M --gguf model-f16.gguf

The copy of ``model.Q4_1.gguf`` in type ``Q4_K_M`` is ``<cache>/gguf/model.Q4_K_M.gguf`` (the
source's own type suffix, if any, replaced); one already there is reused. The bundled model is
itself quantized (Q4_1), so ``--allow-requantize`` is always passed: its Q4_K_M copy carries Q4_1's
rounding on top of its own, which changes no speed. ``llama-quantize`` comes from the same build as
the benchmark tools (``benchmarks/llamacpp/build.py``). Rows whose length a K-quant does not divide
(Qwen2.5-0.5B's 896) get llama-quantize's own fallback type; ``tensor_type_counts`` says what a
file ended up holding.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

from engine.model.gguf_cache import bundled_gguf_path, cache_root

QUANTIZE_TOOL = "llama-quantize"
BUNDLED_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
_TYPE_SUFFIX = re.compile(r"[.-](f16|bf16|f32|q\d\w*)$", re.IGNORECASE)


def requantized_name(source: Path, quant_type: str) -> str:
    """``model.Q4_1.gguf`` -> ``model.Q4_K_M.gguf``, ``random-1b-f16.gguf`` ->
    ``random-1b.Q4_K_M.gguf``."""
    return f"{_TYPE_SUFFIX.sub('', source.stem)}.{quant_type.upper()}.gguf"


def quantize_command(
    tool: Path, source: Path, target: Path, quant_type: str, threads: int
) -> list[str]:
    """The ``llama-quantize`` command line writing ``target`` from ``source``."""
    return [
        str(tool), "--allow-requantize", str(source), str(target), quant_type.upper(),
        str(threads),
    ]  # fmt: skip


def requantized_path(
    source: Path,
    quant_type: str,
    folder: Path | None = None,
    tools: Path | None = None,
    threads: int | None = None,
) -> Path:
    """The ``quant_type`` copy of ``source`` in ``folder`` (default ``<cache>/gguf``), made with
    the ``llama-quantize`` in ``tools`` (default: the cached build, built when absent) if absent."""
    folder = folder or cache_root() / "gguf"
    target = folder / requantized_name(source, quant_type)
    if target.is_file():
        return target
    if tools is None:
        from benchmarks.llamacpp.build import QUANTIZE, ensure_tools

        tools = ensure_tools(tools=QUANTIZE)
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    command = quantize_command(
        tools / QUANTIZE_TOOL, source, partial, quant_type, threads or os.cpu_count() or 1
    )
    print(f"writing {target} (once)", flush=True)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-2000:]}")
    os.replace(partial, target)
    return target


def tensor_type_counts(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type ``path`` holds, most frequent first."""
    from gguf import GGUFReader

    counts = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors)
    return dict(counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*", default=list(BUNDLED_TYPES), help="Q4_K_M, Q8_0, ...")
    parser.add_argument("--gguf", type=Path, help="the file to requantize (default: the bundled)")
    parser.add_argument("--tools", type=Path, help="a folder holding llama-quantize (else built)")
    parser.add_argument("--threads", type=int, help="llama-quantize threads (default: all cores)")
    args = parser.parse_args()
    source = args.gguf or bundled_gguf_path()
    for quant_type in args.types:
        path = requantized_path(source, quant_type, tools=args.tools, threads=args.threads)
        print(path, path.stat().st_size, tensor_type_counts(path))


if __name__ == "__main__":
    main()
