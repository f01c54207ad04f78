"""The token embedding table: dense, or a GGUF's own blocks with only the looked-up rows
dequantized (a 128k-token vocabulary at 2,048 features is 1 GiB in float32, against 0.3 GiB as
``Q8_0`` and less as a K-quant), so ``weight_dtype: auto`` keeps no float32 copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.quantized import QuantizedWeight


@dataclass
class DenseEmbedding:
    table: torch.Tensor  # [vocab, hidden]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table)

    @property
    def kind(self) -> str:
        return str(self.table.dtype).removeprefix("torch.")


@dataclass
class QuantizedEmbedding:
    table: QuantizedWeight  # [vocab, hidden] in blocks: a row per token

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.table.blocks.index_select(0, flat)
        chosen = QuantizedWeight(rows, self.table.kind, flat.numel(), self.table.k)
        return chosen.dequantize().reshape(*ids.shape, self.table.k)

    @property
    def kind(self) -> str:
        return self.table.kind


TokenEmbedding = DenseEmbedding | QuantizedEmbedding
