"""Random but valid GGUF blocks of every kind the quantized kernels take: random quant bytes, and
finite fp16 scales and minima of a chosen magnitude (half weights: random finite values)."""

from __future__ import annotations

import numpy as np

from engine.kernels import quantized

# Byte offsets of each kind's fp16 scales (d, and dmin for the K kinds) and of its fp16 minimum.
SCALE_OFFSETS = {
    "q8_0": [0], "q4_0": [0], "q4_1": [0], "q5_0": [0], "q5_1": [0],
    "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
}  # fmt: skip
MINIMUM_OFFSETS = {"q4_1": 2, "q5_1": 2}
# Where each kind with offsets keeps its quant bits: zeroing them leaves each weight's offset.
QUANT_BITS_FROM = {"q4_1": 4, "q5_1": 4, "q4_k": 16, "q5_k": 16}


def random_blocks(
    kind: str, n: int, k: int, seed: int = 0, scales: tuple[float, float] = (1e-3, 1e-1)
) -> np.ndarray:
    """uint8 ``[n, k / block weights * block bytes]`` blocks of ``kind``; scales (and minima, in
    +-scales[1]) drawn uniformly from ``scales``."""
    rng = np.random.default_rng(seed)
    if kind in ("f16", "bf16"):
        values = (rng.standard_normal((n, k)) * scales[1]).astype(np.float32)
        if kind == "f16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    num_blocks = k // quantized.BLOCK_WEIGHTS[kind]
    blocks = rng.integers(0, 256, (n, num_blocks, quantized.BLOCK_BYTES[kind]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        blocks[..., offset : offset + 2] = _halves(rng.uniform(*scales, (n, num_blocks)))
    if kind in MINIMUM_OFFSETS:
        offset = MINIMUM_OFFSETS[kind]
        minima = rng.uniform(-scales[1], scales[1], (n, num_blocks))
        blocks[..., offset : offset + 2] = _halves(minima)
    return blocks.reshape(n, -1)


def offsets_only(blocks: np.ndarray, kind: str) -> np.ndarray:
    """``blocks`` with every quant bit zeroed: they dequantize to each weight's offset (the
    block minimum, or -dmin * m_j), zero for kinds without one."""
    if kind not in QUANT_BITS_FROM:
        return np.zeros_like(blocks)
    grouped = blocks.reshape(blocks.shape[0], -1, quantized.BLOCK_BYTES[kind]).copy()
    grouped[..., QUANT_BITS_FROM[kind] :] = 0
    return grouped.reshape(blocks.shape)


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)
