"""Whether ``quantized_avx2_legacy.h`` earns its lines: the AVX2 kernel of Q4_1 as shipped (that
header's path) against the same kind through ``quantized_simd.h`` on 8 lanes (the path every other
kind takes on AVX2; Q8_0 took the header's too until this benchmark found it no faster), in one
run.

    python -m benchmarks.engine.avx2_paths      # -> benchmarks/results/avx2_paths.json
    python -m benchmarks.engine.avx2_paths --scratch --rounds 2 --repeats 20   # quick

The second side is the shipped kernel sources with the line that sends Q4_1 to the legacy path,
and the guards that keep it off the simd path, taken out (``LEGACY_DISPATCH``,
``SIMD_GUARD``), built beside the shipped module; both run on AVX2
(``set_isa("avx2")``) with one thread, as a worker of a 2-core machine does. Each round times,
for every shape and row count, ``--repeats`` products on each side, the sides back to back
and the first alternating (``benchmarks.harness.rounds``); a round's figure is legacy's speed-up,
the simd path's time over the legacy path's. The header earns its lines on a kind where the
speed-up's interval clears ``GOAL`` at one row (a decode step).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.harness.kernel_cases import (
    KernelCase,
    TimeSide,
    kernel_rounds,
    micros_per_call,
    speedup_cases,
)
from benchmarks.harness.results import ResultFile, add_output_arguments
from benchmarks.harness.rounds import DEFAULT_ROUNDS
from benchmarks.harness.stats import Goal
from engine.kernels import build_extension
from engine.kernels.quantized import SOURCE, quantize, quantized_kernels

# the dispatch to the legacy path, and the guards that keep its two kinds off the simd path
LEGACY_DISPATCH = "  if (K == Kind::q4_1) return KernelPath::legacy_avx2;\n"
SIMD_GUARD = "      if constexpr (K != Kind::q4_1)\n"
KINDS = ("q4_1",)
# [N, k] of the bundled model's projections (576 wide, MLP 1536) and of a 1B model's (2048, 8192)
SHAPES = ((1536, 576), (576, 1536), (2048, 2048), (8192, 2048))
ROWS = (1, 8)
GOAL = Goal(1.03)  # a few percent: below that the header costs more than it gives


def simd_only_module() -> ModuleType:
    """The shipped kernel sources built with Q4_1 on the simd path."""
    folder = Path(tempfile.mkdtemp(prefix="pdserve-avx2-paths-"))
    for path in [SOURCE, *SOURCE.parent.glob("*.h")]:
        shutil.copy(path, folder / path.name)
    dispatch = folder / "quantized_linear.h"
    text = dispatch.read_text()
    if text.count(LEGACY_DISPATCH) != 1 or text.count(SIMD_GUARD) != 2:
        raise SystemExit("quantized_linear.h no longer dispatches as this benchmark expects")
    dispatch.write_text(text.replace(LEGACY_DISPATCH, "").replace(SIMD_GUARD, ""))
    return build_extension(folder / SOURCE.name)


def time_side(modules: dict[str, ModuleType]) -> TimeSide:
    """Microseconds per product on a side's module."""

    def time_it(side: str, case: KernelCase, n: int) -> float:
        _, kind, x, blocks = case
        return micros_per_call(lambda: modules[side].quantized_linear(x, blocks, kind), n)

    return time_it


def cases() -> list[KernelCase]:
    """(name, kind, x, weight blocks) of every case, drawn once."""
    torch.manual_seed(0)
    found = []
    for kind in KINDS:
        for n, k in SHAPES:
            blocks = quantize(torch.randn(n, k), kind).blocks
            for rows in ROWS:
                found.append((f"{kind} {n}x{k} M={rows}", kind, torch.randn(rows, k), blocks))
    return found


def measure(modules: dict[str, ModuleType], args: argparse.Namespace) -> dict[str, dict]:
    """Each case's microseconds per product on each side, every kept round."""
    return kernel_rounds(
        cases(), list(modules), time_side(modules), args.rounds,
        repeats=lambda rows: args.repeats if rows == 1 else max(1, args.repeats // 4),
    )  # fmt: skip


def report(kept: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> dict[str, Any]:
    """Per case each side's spread and legacy's speed-up with its verdict against ``GOAL``."""
    result: dict[str, Any] = {"goal": str(GOAL), "threads": 1, "repeats": args.repeats}
    return result | speedup_cases(kept, "legacy", "simd", GOAL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "avx2_paths")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--repeats", type=int, default=400, help="products per one-row case")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    torch.set_num_threads(1)
    shipped = quantized_kernels()
    if shipped is None or not shipped.avx2_supported():
        raise SystemExit("needs the native kernels on a CPU with AVX2, FMA and F16C")
    modules = {"legacy": shipped, "simd": simd_only_module()}
    for module in modules.values():
        module.set_isa("avx2")
    result_file.write(report(measure(modules, args), args))


if __name__ == "__main__":
    main()
