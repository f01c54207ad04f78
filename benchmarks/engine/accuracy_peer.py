"""llama.cpp's own accuracy on a file: ``llama-perplexity --kl-divergence`` of the file against
llama.cpp's run of its F32 copy (the same weights, dequantized by ``llama-quantize``), on a text,
window and thread count, parsed from its report."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.llamacpp.build import QUANTIZE, ensure_tools
from benchmarks.llamacpp.requantize import requantized_path
from engine.model.gguf_cache import cache_root

PERPLEXITY = ("llama-perplexity",)
_FIGURES = {
    "kl_mean": re.compile(r"Mean\s+KLD:\s+([-\d.]+)"),
    "kl_mean_se": re.compile(r"Mean\s+KLD:\s+[-\d.]+\s*±\s*([-\d.]+)"),
    "kl_p99": re.compile(r"99\.0%\s+KLD:\s+([-\d.]+)"),
    "kl_max": re.compile(r"Maximum KLD:\s+([-\d.]+)"),
    "top1_agreement": re.compile(r"Same top p:\s+([-\d.]+)\s*±"),
    "perplexity": re.compile(r"Mean PPL\(Q\)\s*:\s+([-\d.]+)"),
    "perplexity_reference": re.compile(r"Mean PPL\(base\)\s*:\s+([-\d.]+)"),
}


def parse_kl_report(text: str) -> dict[str, float]:
    """The figures of a ``--kl-divergence`` report (top-1 agreement as a fraction)."""
    found = {}
    for key, pattern in _FIGURES.items():
        match = pattern.search(text)
        if match is None:
            raise RuntimeError(f"llama-perplexity's report has no {key}:\n{text[-3000:]}")
        found[key] = float(match.group(1))
    found["top1_agreement"] = round(found["top1_agreement"] / 100, 5)
    return found


def perplexity_command(
    tools: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int, base: Path
) -> list[str]:
    return [
        str(tools / PERPLEXITY[0]), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
        "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads), "--kl-divergence-base",
        str(base),
    ]  # fmt: skip


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{output[-3000:]}")
    return output


def llamacpp_kl(gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict[str, Any]:
    """llama.cpp's figures on ``gguf`` against its F32 copy (both built when absent)."""
    tools = ensure_tools(tools=(*PERPLEXITY, *QUANTIZE))
    folder = cache_root() / "gguf" / "f32" / gguf.stem
    reference = requantized_path(gguf, "F32", folder=folder, tools=tools)
    with tempfile.TemporaryDirectory(prefix="pdserve-kld-") as scratch:
        base = Path(scratch) / "base.kld"
        _run(perplexity_command(tools, reference, text, ctx, chunks, threads, base))
        report = _run(
            [*perplexity_command(tools, gguf, text, ctx, chunks, threads, base), "--kl-divergence"]
        )
    return {"reference": reference.name, **parse_kl_report(report)}
