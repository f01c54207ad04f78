"""Compile the native CPU kernels now rather than at the first engine start (each takes up to a
minute on two cores; later starts import them from torch's extension cache). Where the toolchain
is missing it says so, and pdserve runs the torch paths."""

from __future__ import annotations

import logging

from engine.kernels import cpu_kernels
from engine.kernels.quantized import quantized_kernels
from engine.model.decode_layers import decode_layer_kernels


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for build in (cpu_kernels, quantized_kernels, decode_layer_kernels):
        build()


if __name__ == "__main__":
    main()
