"""A decode step's decoder layers in one native call (``engine/kernels/decode_layers_cpu.cpp``).

Decode steps of up to ``FUSED_MAX_ROWS`` sequences on the CPU in float32 run every layer (norms,
projections, rotary, the KV cache write, paged attention, SwiGLU, residuals) without returning
to Python; prompts and larger batches run the op-by-op path in ``llama.py``. Both compute the
same operations in the same order on the same kernels, so their results agree to float32
rounding (``tests/engine/model/test_decode_layers.py``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from engine import kernels
from engine.kernels.quantized import NATIVE_MAX_ROWS
from engine.model.linear import DenseLinear, Linear, PartsLinear, QuantizedLinear

if TYPE_CHECKING:
    from engine.model.llama import LlamaModel

log = logging.getLogger(__name__)

SOURCE = Path(kernels.__file__).with_name("decode_layers_cpu.cpp")
# Rows (sequences) a fused step takes: the quantized kernels' native range.
FUSED_MAX_ROWS = NATIVE_MAX_ROWS


@functools.cache
def decode_layer_kernels() -> ModuleType | None:
    """The compiled module, or None (see ``kernels.load_native``)."""
    return kernels.load_native(SOURCE, "decode layers", log)


def fuse_layers(model: LlamaModel) -> Any | None:
    """``DecodeLayers`` holding ``model``'s layers, or None where it cannot run them: no native
    module, or a quantized projection whose inputs are not whole blocks of its kind."""
    module = decode_layer_kernels()
    if module is None:
        return None
    projections = [
        [_projection(linear) for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        for layer in model.layers
    ]
    if any(p is None for layer in projections for p in layer):
        log.info("decode layers: op by op (a quantized projection's inputs are not whole blocks)")
        return None
    s = model.shape
    fused = module.DecodeLayers(
        s.num_heads, s.num_kv_heads, s.head_dim, model.eps, model.scale,
        model.rotary.cos, model.rotary.sin,
    )  # fmt: skip
    for layer, layer_projections in zip(model.layers, projections, strict=True):
        fused.add_layer(layer.input_norm, layer.post_norm, layer_projections)
    return fused


def _projection(linear: Linear) -> tuple | None:
    """``([(weight, kind, n, k), ...], bias)`` as ``DecodeLayers.add_layer`` takes a projection
    (one part, or one per format of a ``PartsLinear``), or None where a part's inputs are not
    whole blocks of its kind."""
    parts = linear.parts if isinstance(linear, PartsLinear) else [linear]
    specs = [_part(part) for part in parts]
    if any(spec is None for spec in specs):
        return None
    return specs, linear.bias


def _part(linear: DenseLinear | QuantizedLinear) -> tuple | None:
    if isinstance(linear, DenseLinear):
        k, n = linear.weight_t.shape
        return linear.weight_t, "dense", n, k
    weight = linear.weight
    if weight.k != weight.padded_k:
        return None
    return weight.blocks, weight.kind, weight.n, weight.k
