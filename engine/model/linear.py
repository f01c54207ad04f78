"""The model's linear layers: dense matrices stored transposed (``[in, out]``, which the CPU GEMM
kernels run markedly faster than ``F.linear``'s ``[out, in]`` at the batch sizes we see), or
weights kept as quantized blocks (``engine.kernels.quantized``). Several projections that read the
same input (q/k/v; gate/up) are fused into one layer at load time, dense or quantized alike; where
a GGUF keeps them in different formats (``Q4_K_M`` stores some ``v`` projections in ``Q6_K`` beside
``Q4_K`` queries and keys) the layer is a ``PartsLinear``: one part per run of equal formats, side
by side, so every matrix keeps its own blocks.

``WEIGHT_DTYPES``: ``auto`` (a GGUF's own blocks where the engine computes in fp32 on the CPU,
lossless with respect to the file; dense elsewhere), ``fp32`` (dense, in the engine's dtype),
``int8`` / ``int4`` (the dense weights quantized at load: Q8_0 / Q4_1 blocks; lossy, opt-in).
"""

from __future__ import annotations

import itertools
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

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` a row at a time: a GEMM's sums depend on how many rows it multiplies."""
        if x.shape[0] < 2:
            return self(x)
        return torch.cat([self(x[i : i + 1]) for i in range(x.shape[0])])

    @property
    def kind(self) -> str:
        return str(self.weight_t.dtype).removeprefix("torch.")


@dataclass
class QuantizedLinear:
    weight: QuantizedWeight
    bias: torch.Tensor | None = None
    # what prompts (more rows than the native kernel takes) are multiplied in: float32, or
    # bfloat16 (``prompt_matmul_dtype``; quantized.dequantized_matmul)
    gemm_dtype: torch.dtype = torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = quantized_linear(x, self.weight, self.gemm_dtype)
        return out if self.bias is None else out + self.bias

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` on the native kernel at any row count, which sums each row alike."""
        out = quantized_linear(x, self.weight, self.gemm_dtype, rowwise=True)
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return self.weight.kind


@dataclass
class PartsLinear:
    """Projections that read the same input, in different formats, written side by side."""

    parts: list[DenseLinear | QuantizedLinear]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    def rowwise(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)``, each row computed as it would be alone (batch invariance)."""
        out = torch.cat([part.rowwise(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

    @property
    def kind(self) -> str:
        return "+".join(part.kind for part in self.parts)


Linear = DenseLinear | QuantizedLinear | PartsLinear


def dense(matrices: Sequence[torch.Tensor], bias: torch.Tensor | None = None) -> DenseLinear:
    """One layer computing ``matrices`` (each ``[out_i, in]``) side by side."""
    return DenseLinear(torch.cat(list(matrices)).t().contiguous(), bias)


def from_gguf(matrices: Sequence[GGUFMatrix], bias: torch.Tensor | None = None) -> Linear:
    """One layer computing a GGUF's ``matrices`` (same input) side by side: a ``QuantizedLinear``
    where they share a block format, else a ``PartsLinear`` with one part per run of formats."""
    if len({m.cols for m in matrices}) != 1:
        raise ValueError(f"cannot fuse matrices of {sorted({m.cols for m in matrices})} inputs")
    runs = [list(run) for _, run in itertools.groupby(matrices, key=lambda m: m.kind)]
    if len(runs) == 1:
        return QuantizedLinear(_blocks_of(runs[0]), bias)
    return PartsLinear([QuantizedLinear(_blocks_of(run)) for run in runs], bias)


def mixed(parts: Sequence[GGUFMatrix | torch.Tensor], bias: torch.Tensor | None = None) -> Linear:
    """One layer over ``parts`` (same input): GGUF matrices keep their blocks, float matrices
    (``[out_i, in]``, a format without a kernel, dequantized at load) are computed dense."""
    if all(isinstance(p, GGUFMatrix) for p in parts):
        return from_gguf(parts, bias)  # type: ignore[arg-type]
    if not any(isinstance(p, GGUFMatrix) for p in parts):
        return dense(parts, bias)  # type: ignore[arg-type]
    layers: list[DenseLinear | QuantizedLinear] = []
    for is_gguf, run in itertools.groupby(parts, key=lambda p: isinstance(p, GGUFMatrix)):
        group = list(run)
        layer = from_gguf(group) if is_gguf else dense(group)  # type: ignore[arg-type]
        layers.extend(layer.parts if isinstance(layer, PartsLinear) else [layer])
    return PartsLinear(layers, bias)


def _blocks_of(matrices: Sequence[GGUFMatrix]) -> QuantizedWeight:
    blocks = np.concatenate([m.blocks for m in matrices])
    rows = sum(m.rows for m in matrices)
    return from_gguf_blocks(blocks, matrices[0].kind, rows, matrices[0].cols)


def quantized(
    matrices: Sequence[torch.Tensor], weight_dtype: str, bias: torch.Tensor | None = None
) -> QuantizedLinear:
    """``matrices`` (float, ``[out_i, in]``) quantized as ``weight_dtype`` (int8, int4)."""
    weight = torch.cat([m.float() for m in matrices])
    return QuantizedLinear(quantize(weight, QUANTIZE_AS[weight_dtype]), bias)
