"""The model's linear layers: dense matrices stored transposed (``[in, out]``, which the CPU GEMM
kernels run markedly faster than ``F.linear``'s ``[out, in]`` at the batch sizes we see), or
weights kept as quantized blocks (``engine.kernels.quantized``). Several projections that read the
same input (q/k/v; gate/up) are fused into one layer at load time, dense or quantized alike.

``WEIGHT_DTYPES``: ``auto`` (a GGUF's own blocks where the engine computes in fp32 on the CPU,
lossless with respect to the file; dense elsewhere), ``fp32`` (dense, in the engine's dtype),
``int8`` / ``int4`` (the dense weights quantized at load: Q8_0 / Q4_1 blocks; lossy, opt-in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import WEIGHT_DTYPES as WEIGHT_DTYPES
from engine.kernels.quantized import QuantizedWeight, from_gguf_blocks, quantize, quantized_linear
from engine.model.gguf_weights import GGUFMatrix

QUANTIZE_AS = {"int8": "q8_0", "int4": "q4_1"}


@dataclass
class DenseLinear:
    weight_t: torch.Tensor  # [in, out]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @property
    def kind(self) -> str:
        return str(self.weight_t.dtype).removeprefix("torch.")


@dataclass
class QuantizedLinear:
    weight: QuantizedWeight
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = quantized_linear(x, self.weight)
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return self.weight.kind


Linear = DenseLinear | QuantizedLinear


def dense(matrices: Sequence[torch.Tensor], bias: torch.Tensor | None = None) -> DenseLinear:
    """One layer computing ``matrices`` (each ``[out_i, in]``) side by side."""
    return DenseLinear(torch.cat(list(matrices)).t().contiguous(), bias)


def from_gguf(matrices: Sequence[GGUFMatrix], bias: torch.Tensor | None = None) -> QuantizedLinear:
    """One layer computing a GGUF's ``matrices`` (same block kind, same input) side by side."""
    kinds = {m.kind for m in matrices}
    if len(kinds) != 1 or len({m.cols for m in matrices}) != 1:
        raise ValueError(f"cannot fuse {[(m.kind, m.cols) for m in matrices]}")
    blocks = np.concatenate([m.blocks for m in matrices])
    rows = sum(m.rows for m in matrices)
    return QuantizedLinear(from_gguf_blocks(blocks, kinds.pop(), rows, matrices[0].cols), bias)


def quantized(
    matrices: Sequence[torch.Tensor], weight_dtype: str, bias: torch.Tensor | None = None
) -> QuantizedLinear:
    """``matrices`` (float, ``[out_i, in]``) quantized as ``weight_dtype`` (int8, int4)."""
    weight = torch.cat([m.float() for m in matrices])
    return QuantizedLinear(quantize(weight, QUANTIZE_AS[weight_dtype]), bias)
