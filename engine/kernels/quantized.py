"""Weight-only quantized linear layers on GGUF blocks: ``x @ w.T`` with ``x`` in float32 and ``w``
kept block for block as a GGUF file stores it, so a GGUF's weights need no float32 copy.

    kind  weights bytes  layout                                                 weight
    q8_0     32     34   fp16 d, 32 int8 q                                      d * q
    q4_0     32     18   fp16 d, 16 bytes of nibbles                            d * (q - 8)
    q4_1     32     20   fp16 d, fp16 m, 16 bytes of nibbles                    d * q + m
    q5_0     32     22   fp16 d, 4 bytes of 5th bits, 16 bytes of nibbles       d * (q - 16)
    q5_1     32     24   fp16 d, fp16 m, 4 bytes of 5th bits, nibbles           d * q + m
    q4_k    256    144   fp16 d, dmin, 8 6-bit scales and mins, 128 B nibbles   d*sc_j*q - dmin*m_j
    q5_k    256    176   as q4_k with 32 bytes of 5th bits before the nibbles   d*sc_j*q - dmin*m_j
    q6_k    256    210   128 B low 4 bits, 64 B high 2 bits, 16 int8 sc_j, d    d * sc_j * (q - 32)
    f16      32     64   the weights as IEEE halves                             the half
    bf16     32     64   the weights as bfloat16                                the bfloat16

(``j`` counts sub-blocks of 32 weights, of 16 for q6_k; the exact bit layouts are in the
kernels' headers, ``quantized_legacy.h`` and ``quantized_kquants.h``.) Half-precision weights
stay halves, counted in "blocks" of 32 so that every kind tiles alike.

A weight is a uint8 tensor ``[N, ceil(K / block weights) * block bytes]`` (rows are output
features), which is how ``gguf.GGUFReader`` exposes such a tensor's data; the 256-weight kinds
need K to be a multiple of 256. With float32 activations (the default) the results equal
``x @ dequantize(w).T`` in float32 up to summation order; with ``activation_dtype: int8``
(``engine.kernels.isa``) the native kernel quantizes rows of x to 8-bit groups for steps of up
to 8 rows (4 for the 32-weight kinds) and multiplies in integers (``quantized_int8.h``), which
moves results beyond that.

Up to ``NATIVE_MAX_ROWS`` rows of ``x`` (decode steps) run the native kernel
(``quantized_linear_cpu.cpp``), which turns each block into floats in registers (AVX-512, AVX2
or portable code: ``engine.kernels.isa`` decides which, once per process). More rows run a
float32 GEMM on the weights dequantized a tile of output rows at a time (a few MB, never the whole
matrix). Without the native module (``PDSERVE_NATIVE_KERNELS=0``, no toolchain) every call takes
the tiled path, dequantizing with torch (with gguf's numpy code for the kinds beyond Q8_0, Q4_1).

Milliseconds per call on 2 AMD EPYC (Zen 3) cores, weights hot in cache, for the bundled model's
layers (K = 576, except down: K = 1536; output features in the header; Q4_1, and Q8_0 for the
head): a float32 ``x @ w_t`` on a float32 ``[K, N]`` copy (what a float32 model runs) / this
native kernel / the tiled dequantize + GEMM path:

threads, M      gate+up 3072          down 576           qkv 960             o 576        head 49152
1, 1       0.160/0.142/0.395 0.085/0.062/0.155 0.054/0.045/0.115 0.034/0.028/0.075 4.903/2.489/8.636
1, 2       0.326/0.207/0.515 0.168/0.106/0.226 0.133/0.067/0.165 0.065/0.040/0.098   10.2/3.818/12.3
1, 4       0.450/0.271/0.646 0.178/0.140/0.313 0.138/0.089/0.203 0.069/0.053/0.120   32.8/5.209/14.5
1, 8       0.624/0.431/0.813 0.262/0.229/0.397 0.176/0.137/0.443 0.096/0.082/0.147   32.8/7.729/13.9
1, 16      0.955/0.878/1.105 0.454/0.484/0.566 0.529/0.592/0.445 0.160/0.167/0.209    36.8/13.4/19.4
1, 32      1.530/1.774/2.255 0.766/0.961/0.876 0.599/1.134/1.077 0.291/0.334/0.332    48.1/27.7/29.7
1, 48      2.748/2.658/2.879 1.143/1.382/1.162 0.949/1.099/1.429 0.388/0.498/0.433    58.6/54.8/49.8
1, 64      3.389/3.723/4.355 1.511/1.903/1.479 1.728/2.062/0.893 0.504/0.681/0.568    86.2/63.2/56.9
1, 128     6.195/7.489/6.226 2.667/4.000/3.147 1.635/2.245/1.698 0.967/1.340/1.036 146.1/123.8/119.5
2, 1       0.218/0.095/0.452 0.104/0.043/0.198 0.054/0.031/0.401 0.035/0.023/0.200 4.306/1.835/6.847
2, 2       0.442/0.127/1.534 0.176/0.070/0.301 0.106/0.040/0.516 0.083/0.029/0.276 8.855/1.893/8.172
2, 4       0.754/0.178/1.503 0.218/0.102/0.864 0.153/0.050/0.438 0.097/0.034/0.308   25.0/2.427/25.4
2, 8       0.847/0.295/2.165 0.255/0.155/0.949 0.182/0.113/0.617 0.101/0.049/0.358   28.6/4.295/29.8
2, 16      1.401/0.572/2.254 0.341/0.435/0.557 0.261/0.182/0.734 0.126/0.118/0.417   35.6/8.836/31.0
2, 32      2.325/1.171/3.060 0.527/0.602/0.688 0.424/0.313/0.804 0.230/0.215/0.508    36.1/14.1/33.9
2, 48      3.041/1.688/3.724 0.691/0.947/0.861 0.480/0.453/0.960 0.293/0.364/0.611    42.4/20.7/42.8
2, 64      3.018/2.279/3.836 0.789/1.191/1.054 0.600/0.727/1.006 0.410/0.422/0.657    51.5/28.1/51.0
2, 128     5.756/4.660/5.754 1.492/2.349/1.611 1.061/1.186/1.581 0.631/0.690/0.918    75.7/57.5/83.1

(Repeated runs on that virtual machine vary by 10-30%.) Against dequantize + GEMM, the native
kernel wins at every size up to 8 rows, and up to 32 rows with two threads; with one thread, at
16-32 rows the two are within that noise (the native kernel ahead on every layer in one run,
5-25% behind on qkv, down and o in another), and from 48 rows dequantize + GEMM mostly wins.
Hence ``NATIVE_MAX_ROWS = 32``. With the weights streamed from memory, as in a whole model (64
copies of a layer cycled), one row takes 0.15 ms against 0.36 ms in float32 for gate+up and
0.065 against 0.25 for down on one thread (0.11 / 0.34 and 0.042 / 0.25 on two).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quantized_linear_cpu.cpp")
# Weights and bytes per block of each kind.
BLOCK_WEIGHTS = {
    "q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32,
    "q4_k": 256, "q5_k": 256, "q6_k": 256, "f16": 32, "bf16": 32,
}  # fmt: skip
BLOCK_BYTES = {
    "q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24,
    "q4_k": 144, "q5_k": 176, "q6_k": 210, "f16": 64, "bf16": 64,
}  # fmt: skip
# Kinds gguf's Python code can quantize (the K kinds it only reads).
QUANTIZABLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16")
NATIVE_MAX_ROWS = 32
# Floats of dequantized weights per tile of the GEMM path (8 MiB; measured: 1 MiB tiles run the
# GEMM 10-40% slower than 4 MiB; 8 MiB holds a small model's fused gate/up [3072, 576] whole, so
# its GEMM writes the output in place: 11.6 ms against 13.0 with two 4 MiB tiles at 512 rows,
# where a dense float32 copy takes 11.2).
_TILE_FLOATS = 1 << 21

# dequantize_into(blocks, kind, out): writes the float32 weights of ``blocks`` into ``out``.
Dequantizer = Callable[[torch.Tensor, str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class QuantizedWeight:
    """A ``[n, k]`` weight as GGUF blocks: ``blocks`` is uint8 ``[n, ceil(k / block weights) *
    block bytes]``; the weights past ``k`` in the last block of a row are padding and meet zeros
    in ``x``. The 256-weight kinds take no padding: their ``k`` is a multiple of 256."""

    blocks: torch.Tensor
    kind: str
    n: int
    k: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unknown kind {self.kind!r} (one of {sorted(BLOCK_BYTES)})")
        block = BLOCK_WEIGHTS[self.kind]
        if block > 32 and self.k % block:
            raise ValueError(f"{self.kind} weights need k a multiple of {block}, not {self.k}")
        expected = (self.n, math.ceil(self.k / block) * BLOCK_BYTES[self.kind])
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(
                f"{self.kind} blocks for a [{self.n}, {self.k}] weight are uint8 {list(expected)}, "
                f"not {self.blocks.dtype} {list(self.blocks.shape)}"
            )
        if not self.blocks.is_contiguous():
            object.__setattr__(self, "blocks", self.blocks.contiguous())

    @property
    def padded_k(self) -> int:
        block = BLOCK_WEIGHTS[self.kind]
        return math.ceil(self.k / block) * block

    def dequantize(self) -> torch.Tensor:
        """The weights as float32 ``[n, k]``, as ggml dequantizes them."""
        weights = torch.empty(self.n, self.padded_k, dtype=torch.float32)
        _dequantizer()(self.blocks, self.kind, weights)
        return weights if self.k == self.padded_k else weights[:, : self.k].contiguous()


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """Quantize a float ``[n, k]`` weight the way gguf does (one of ``QUANTIZABLE``), padding each
    row with zeros up to a multiple of 32."""
    if weight.dim() != 2:
        raise ValueError(f"a weight is 2-D [n, k], not {list(weight.shape)}")
    if kind not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {kind!r} (one of {', '.join(QUANTIZABLE)})")
    n, k = weight.shape
    padded = F.pad(weight.detach().to(torch.float32).cpu(), (0, -k % BLOCK_WEIGHTS[kind]))
    blocks = _gguf_quantize(padded.numpy(), kind)
    return QuantizedWeight(torch.from_numpy(blocks), kind, n, k)


def from_gguf_blocks(data: np.ndarray, kind: str, n: int, k: int) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (``GGUFReader``'s ``tensor.data``) as a weight of ``n`` outputs
    and ``k`` inputs. A read-only array (a memory-mapped file) is copied."""
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if not blocks.flags.writeable:
        blocks = blocks.copy()
    return QuantizedWeight(torch.from_numpy(blocks), kind, n, k)


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    gemm_dtype: torch.dtype = torch.float32,
    rowwise: bool = False,
) -> torch.Tensor:
    """``x @ dequantize(weight).T`` for float32 ``x`` of shape ``[..., k]``; returns
    ``[..., n]`` in float32. ``gemm_dtype`` is what the tiled GEMM path (more than
    ``NATIVE_MAX_ROWS`` rows) multiplies in: float32, or bfloat16 (``dequantized_matmul``).
    ``rowwise``: the native kernel at any row count (each row summed as it would be alone)."""
    if x.dtype != torch.float32 or x.shape[-1] != weight.k:
        raise ValueError(f"x must be float32 [..., {weight.k}], not {x.dtype} {list(x.shape)}")
    rows = x.reshape(-1, weight.k)
    padded = _padded(rows, weight.padded_k)
    native = quantized_kernels()
    if native is not None and (rowwise or padded.shape[0] <= NATIVE_MAX_ROWS):
        out = native.quantized_linear(padded, weight.blocks, weight.kind)
    else:
        out = dequantized_matmul(padded, weight, _dequantizer(), gemm_dtype)
    return out.reshape(*x.shape[:-1], weight.n)


def _padded(rows: torch.Tensor, padded_k: int) -> torch.Tensor:
    if rows.shape[1] == padded_k:
        return rows.contiguous()
    return F.pad(rows, (0, padded_k - rows.shape[1]))


def dequantized_matmul(
    x: torch.Tensor,
    weight: QuantizedWeight,
    dequantize_into: Dequantizer,
    gemm_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x @ w.T`` for ``x`` of shape ``[m, padded_k]``, dequantizing ``w`` a tile of output rows
    at a time into one reused buffer with ``dequantize_into(blocks, kind, out)``.

    With ``gemm_dtype`` bfloat16, ``x`` and each tile are rounded to bfloat16 and multiplied
    there (float32 sums inside the GEMM, the products rounded to bfloat16 before they are stored
    as float32): lossy, and on CPUs that execute AVX512_BF16 3-4x faster than float32 (on 2 Zen 4
    cores, 512 prompt rows: 2.9 against 10.8 ms for a [3072, 576] Q4_1 matrix, 27 against 90 ms
    for [8192, 2048] Q4_K). Without those instructions torch emulates it, far slower."""
    tile = max(1, min(weight.n, _TILE_FLOATS // weight.padded_k))
    buffer = torch.empty(tile, weight.padded_k, dtype=torch.float32)
    if gemm_dtype != torch.float32:
        x = x.to(gemm_dtype)
    if tile == weight.n:
        w = dequantize_into(weight.blocks, weight.kind, buffer)
        return (x @ w.to(x.dtype).t()).float()
    out = torch.empty(x.shape[0], weight.n, dtype=torch.float32)
    for start in range(0, weight.n, tile):
        stop = min(start + tile, weight.n)
        w_tile = dequantize_into(weight.blocks[start:stop], weight.kind, buffer[: stop - start])
        out[:, start:stop] = x @ w_tile.to(x.dtype).t()
    return out


def torch_dequantize_into(blocks: torch.Tensor, kind: str, out: torch.Tensor) -> torch.Tensor:
    """``torch_dequantize`` written into ``out``."""
    return out.copy_(torch_dequantize(blocks, kind))


def torch_dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """GGUF blocks ``[rows, nb * block bytes]`` as float32 ``[rows, nb * block weights]``: Q8_0
    and Q4_1 in torch, the other kinds with gguf's numpy code."""
    rows = blocks.shape[0]
    if kind not in ("q8_0", "q4_1"):
        weights = gguf_dequantize(blocks.contiguous().numpy(), _ggml_type(kind))
        return torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32)).reshape(rows, -1)
    grouped = blocks.reshape(rows, -1, BLOCK_BYTES[kind])
    scale = _halves(grouped[..., 0:2])
    if kind == "q8_0":
        values = grouped[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        return (scale * values).reshape(rows, -1)
    low_bound = _halves(grouped[..., 2:4])
    nibbles = grouped[..., 4:]
    values = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.float32)
    return (scale * values + low_bound).reshape(rows, -1)


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    return pairs.contiguous().view(torch.float16).to(torch.float32)


def _ggml_type(kind: str) -> GGMLQuantizationType:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[kind.upper()]


def gguf_dequantize(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's own numpy dequantization (the reference every path here matches bit for bit)."""
    from gguf.quants import dequantize

    return dequantize(blocks, qtype)


def _gguf_quantize(weight: np.ndarray, kind: str) -> np.ndarray:
    from gguf.quants import quantize as gguf_quantize

    blocks = np.ascontiguousarray(gguf_quantize(weight, _ggml_type(kind)))
    return blocks.view(np.uint8).reshape(weight.shape[0], -1)


def _dequantizer() -> Dequantizer:
    native = quantized_kernels()
    return native.dequantize_into if native is not None else torch_dequantize_into


@functools.cache
def quantized_kernels() -> ModuleType | None:
    """The compiled module, or None when disabled (``PDSERVE_NATIVE_KERNELS=0``) or when the
    toolchain is missing; raises ``KernelBuildError`` when the toolchain fails on the source."""
    return kernels.load_native(SOURCE, "quantized linear", log)
