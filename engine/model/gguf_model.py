"""A GGUF model loaded as it is: its configuration and tokenizer from the file's metadata, its
tensors read from the memory-mapped file when the engine asks for them.

No float32 image of the weights is written anywhere. The first start of a file saves only what
transformers builds from the metadata (``config.json``, the tokenizer and its chat template: a
few MB) in a folder of the cache (``metadata_dir_for``), so later starts and every worker skip
the ~10 s that takes. The weights are a :class:`GGUFTensors` mapping under the Hugging Face
names: a tensor is dequantized (``gguf.quants``) only when looked up, so with ``weight_dtype:
auto`` (the file's own blocks, ``gguf_weights.read_quantized``) only the norms, biases and any
matrix without a kernel ever become float32, and nothing holds a dequantized copy after the
model is built. Looked up, every tensor equals what transformers' GGUF conversion gives, bit for
bit (the query and key rows of a ``llama`` file put back in Hugging Face's order, as there).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.errors import ModelLoadError
from engine.model.gguf_weights import (
    LINEAR_PARTS,
    file_tensors,
    interleaved_heads,
    unpermute_rows,
)

log = logging.getLogger(__name__)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> tuple[str | None, str]:
    """The Hugging Face name of a GGUF tensor and its part (``attn_q``, ``token_embd``, ...), or
    ``(None, "")`` for a tensor the engine does not use (``rope_freqs``: the config has it)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name], gguf_name.split(".")[0]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        return None, ""
    layer, part, kind = match.groups()
    if part in LINEAR_PARTS:
        return f"model.layers.{layer}.{LINEAR_PARTS[part]}.{kind}", part
    if part in _NORMS and kind == "weight":
        return f"model.layers.{layer}.{_NORMS[part]}.weight", part
    return None, ""


class GGUFTensors(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by Hugging Face name, each dequantized to float32 as it is looked
    up (never kept); ``hf_config`` says how many query and key heads a ``llama`` file's rows
    interleave."""

    def __init__(self, path: Path, hf_config: Any) -> None:
        self.path = path
        architecture, tensors = file_tensors(path)
        heads = interleaved_heads(architecture, hf_config)
        self._tensors: dict[str, tuple[Any, int | None]] = {}
        for tensor in tensors:
            name, part = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = (tensor, heads.get(part))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.rows(name)

    def rows(self, name: str, count: int | None = None) -> torch.Tensor:
        """Tensor ``name`` (float32, Hugging Face's shape), or only its first ``count`` rows
        (not for a ``llama`` file's query and key matrices, whose rows are reordered)."""
        tensor, heads = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the row length first
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1, _row_bytes(tensor))
        if count is not None:
            if heads is not None:
                raise ValueError(f"{name}: its rows are reordered; take it whole")
            data, shape = data[:count], (min(count, shape[0]), *shape[1:])
        try:
            values = dequantize(data, GGMLQuantizationType(tensor.tensor_type))
        except NotImplementedError as exc:
            raise ModelLoadError(f"{self.path.name}: {name}: {exc}") from exc
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if heads is not None:
            values = unpermute_rows(values, heads)
        if not values.flags.writeable:  # float32 data is a view of the read-only file
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors


def _row_bytes(tensor: Any) -> int:
    """Bytes of one row (the innermost dimension) of ``tensor``."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.tensor_type)]
    return int(tensor.shape[0]) // block * block_bytes
