"""Decode rows on 8-bit activations against float32 activations, kernel by kernel, in one run:
what ``activation_dtype: int8`` buys per product, and up to how many rows (``kInt8MaxRows``, 8)
it should run.

    python -m benchmarks.engine.int8_rows        # -> benchmarks/results/int8_rows.json
    python -m benchmarks.engine.int8_rows --scratch --rounds 2 --repeats 20   # quick

Both sides are the shipped native module on the instruction set this CPU runs
(``engine.kernels.isa``: AVX-512 with VNNI where the probe allows, else AVX2), one thread (a
worker of a 2-core machine), the activation dtype set before each side's products. Each round
times, for every case (a kind, a ``[N, k]`` weight of the bundled model's or a 1B model's shape,
a row count), ``--repeats`` products on each side, back to back, the first alternating
(``benchmarks.harness.rounds``); a round's figure is int8's speed-up, the float32 side's time over
the int8 side's. int8 earns a row count where the speed-up's interval clears ``GOAL``.
"""

from __future__ import annotations

import argparse
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
from engine.kernels.quantized import quantized_kernels
from tests.support.gguf_blocks import random_blocks

# (kind, N, k): the bundled file's Q4_1 MLP and Q8_0 head rows, a 1B model's Q4_K_M projections
CASES = (
    ("q4_1", 1536, 576),
    ("q8_0", 2048, 576),
    ("q4_k", 2048, 2048),
    ("q4_k", 8192, 2048),
    ("q6_k", 2048, 8192),
    ("q8_0", 2048, 2048),
    ("q4_0", 2048, 2048),
    ("q5_k", 2048, 2048),
)
ROWS = (1, 2, 4, 8)
SIDES = ("int8", "float32")
GOAL = Goal(1.0)


def time_side(module: Any) -> TimeSide:
    """Microseconds per product on a side's activation dtype (the side's name)."""

    def time_it(dtype: str, case: KernelCase, n: int) -> float:
        _, kind, x, blocks = case
        module.set_activation_dtype(dtype)
        return micros_per_call(lambda: module.quantized_linear(x, blocks, kind), n)

    return time_it


def drawn_cases() -> list[KernelCase]:
    """(name, kind, x, weight blocks) of every case, drawn once."""
    generator = torch.Generator().manual_seed(0)
    found = []
    for seed, (kind, n, k) in enumerate(CASES):
        blocks = torch.from_numpy(random_blocks(kind, n, k, seed=seed))
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator)
            found.append((f"{kind} {n}x{k} M={rows}", kind, x, blocks))
    return found


def measure(module: Any, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Each case's microseconds per product on each side, every kept round."""
    try:
        return kernel_rounds(
            drawn_cases(), SIDES, time_side(module), args.rounds,
            repeats=lambda rows: max(1, args.repeats // rows),
        )  # fmt: skip
    finally:
        module.set_activation_dtype("float32")


def report(kept: dict[str, dict[str, list[float]]], module: Any, args: argparse.Namespace):
    """Per case each side's spread and int8's speed-up with its verdict against ``GOAL``."""
    result: dict[str, Any] = {
        "goal": str(GOAL),
        "threads": 1,
        "repeats": args.repeats,
        "isa": module.isa(),
        "int8_path": _int8_path(module),
    }
    return result | speedup_cases(kept, "int8", "float32", GOAL)


def _int8_path(module: Any) -> str:
    module.set_activation_dtype("int8")
    try:
        return str(module.int8_path())
    finally:
        module.set_activation_dtype("float32")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_arguments(parser, "int8_rows")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="kept rounds")
    parser.add_argument("--repeats", type=int, default=200, help="products per one-row case")
    args = parser.parse_args(argv)
    result_file = ResultFile.start(args, argv)
    torch.set_num_threads(1)
    module = quantized_kernels()
    if module is None:
        raise SystemExit("needs the native kernels (a C++ toolchain; PDSERVE_NATIVE_KERNELS not 0)")
    result_file.write(report(measure(module, args), module, args))


if __name__ == "__main__":
    main()
