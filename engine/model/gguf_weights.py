"""A GGUF file's quantized matrices, block for block, under the Hugging Face names the engine
uses: what ``weight_dtype: auto`` computes with on a GGUF model instead of its fp32 image.

Each matrix keeps the file's own blocks (``Q4_1``: 32 weights in 20 bytes; ``Q4_K``: 256 in 144;
``F16``: 2 bytes a weight; ``engine/kernels/quantized.py`` lists every format), one row of blocks
per output feature, so nothing is lost with respect to the file. A K-quant file mixes formats
(``Q4_K_M`` keeps some projections in ``Q6_K``, and rows whose length is not a multiple of 256 in
``Q5_0`` or ``Q8_0``): each matrix keeps its own. A matrix in a format without a kernel (``Q2_K``,
``Q3_K``, the ``IQ`` family) is left to the fp32 checkpoint, and one log line per format says so.

The only change is the order of the query and key rows of a ``llama`` file: llama.cpp's converter
interleaves each head's rotary halves there (not in ``qwen2``), and those rows are put back in
Hugging Face's order (a row permutation, exact).
Dequantized, every matrix equals the fp32 weights the converted checkpoint holds, bit for bit.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from engine.model.gguf_index import GGUFFormatError, read_index

log = logging.getLogger(__name__)

# the block formats the engine's kernels compute with
KINDS = {
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q5_0: "q5_0",
    GGMLQuantizationType.Q5_1: "q5_1",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k",
    GGMLQuantizationType.Q6_K: "q6_k",
    GGMLQuantizationType.F16: "f16",
    GGMLQuantizationType.BF16: "bf16",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
LINEAR_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFMatrix:
    """One quantized matrix: ``blocks`` is uint8 ``[rows, blocks_per_row * block_bytes]``."""

    kind: str  # a value of KINDS
    rows: int  # output features
    cols: int  # input features
    blocks: np.ndarray


def read_quantized(path: Path, hf_config: Any) -> dict[str, GGUFMatrix]:
    """The file's matrices in a block format the engine computes with (others, such as norms
    stored in fp32, are left to the fp32 checkpoint), by Hugging Face weight name."""
    architecture, tensors = file_tensors(path)
    heads = interleaved_heads(architecture, hf_config)
    matrices = {}
    without_kernel: Counter[str] = Counter()
    for tensor in tensors:
        kind = KINDS.get(tensor.tensor_type)
        name, part = _hf_name(tensor.name)
        if name is None:
            continue
        if kind is None:
            if tensor.tensor_type != GGMLQuantizationType.F32:
                without_kernel[tensor.tensor_type.name] += 1
            continue
        # quantized data comes as uint8 rows of blocks, F16 as float16 values: both as bytes
        blocks = np.ascontiguousarray(tensor.data).view(np.uint8)
        if part in heads:
            blocks = unpermute_rows(blocks, heads[part])
        cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the row length first
        matrices[name] = GGUFMatrix(kind, rows, cols, blocks)
    for type_name, count in sorted(without_kernel.items()):
        log.warning(
            "%s: %d %s matrices have no kernel: computed as float32, dequantized at load",
            path.name,
            count,
            type_name,
        )
    return matrices


def interleaved_heads(architecture: str, hf_config: Any) -> dict[str, int]:
    """The parts whose rows llama.cpp's converter interleaved per head, with their head counts:
    a ``llama`` file's query and key matrices (only llama's converter does it)."""
    if architecture != "llama":
        return {}
    queries = hf_config.num_attention_heads
    return {
        "attn_q": queries,
        "attn_k": getattr(hf_config, "num_key_value_heads", None) or queries,
    }


def file_tensors(path: Path) -> tuple[str, list[Any]]:
    """The file's architecture and tensors: from its header alone (``gguf_index``), or, for a
    file that reader does not take (big-endian), from ``gguf.GGUFReader``."""
    try:
        index = read_index(path, ("general.architecture",))
    except GGUFFormatError as exc:
        log.info("%s: %s; read with gguf.GGUFReader", path.name, exc)
        reader = GGUFReader(str(path))
        return _architecture(reader), list(reader.tensors)
    return index.strings.get("general.architecture", ""), list(index.tensors)


def _architecture(reader: GGUFReader) -> str:
    field = reader.get_field("general.architecture")
    return "" if field is None else bytes(field.parts[field.data[0]]).decode()


def _hf_name(gguf_name: str) -> tuple[str | None, str]:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight", "token_embd"
    if gguf_name == "output.weight":
        return "lm_head.weight", "output"
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in LINEAR_PARTS:
        return None, ""
    layer, part = match.groups()
    return f"model.layers.{layer}.{LINEAR_PARTS[part]}.weight", part


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the converter's per-head interleaving of the rotary halves (rows only)."""
    half = rows.shape[0] // num_heads // 2
    return np.ascontiguousarray(
        rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
    )
