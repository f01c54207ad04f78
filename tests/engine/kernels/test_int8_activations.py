"""Decode rows on 8-bit activations (``quantized_int8.h``, ``activation_dtype: int8``): every
integer kind on every native path this CPU runs (AVX-512 VNNI, AVX2, the portable scalar code)
against x quantized the same way in numpy and multiplied with gguf's dequantized weights in
float64; the paths against each other; the rows beyond the int8 path's and the half kinds
staying float32; and the rounding of x within what 8 bits a group allow.

The reference rounds x as the kernel does: per group as long as a weight block (32 values, 256
for the K kinds), ``d = max |x| / 127`` and ``round(x * (127 / max |x|))`` half to even, in
float32. Against it only the kernel's float32
sums of scaled integer dot products differ (RTOL of the terms' magnitudes, as in
``test_quantized_kernels.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine import kernels
from engine.kernels import isa, quantized
from tests.support.gguf_blocks import offsets_only, random_blocks

RTOL = 1e-5
INTEGER_KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def max_rows(kind: str) -> int:
    """int8_max_rows: 8 rows of x for the K kinds, 4 for the 32-weight kinds."""
    return 8 if quantized.BLOCK_WEIGHTS[kind] == 256 else 4


@pytest.fixture(params=["vnni", "avx2", "scalar"])
def int8_path(request, native):
    """The native module with 8-bit activations on, running the named integer path."""
    if request.param == "vnni":
        if not (isa.avx512_runs(native) and "avx512_vnni" in _cpu_flags()):
            pytest.skip("AVX-512 VNNI does not run here (cpuid or the probe says no)")
        native.set_isa("avx512")
    elif request.param == "avx2":
        if not native.avx2_supported():
            pytest.skip("this CPU lacks AVX2, FMA or F16C")
        native.set_isa("avx2")
    else:
        native.set_isa("scalar")
    native.set_activation_dtype("int8")
    assert native.int8_path() == request.param and native.activation_dtype() == "int8"
    yield native
    native.set_activation_dtype("float32")
    isa.apply_isa(native)


def _cpu_flags() -> set[str]:
    from engine.kernels import cpu_identity

    return set(cpu_identity().replace("|", " ").split())


def _kind_k(kind: str) -> int:
    return 512 if quantized.BLOCK_WEIGHTS[kind] == 256 else 96


def _weights(kind: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks, gguf's dequantized weights and each weight's offset, float64 ``[n, k]``."""
    blocks = random_blocks(kind, n, k, seed)
    qtype = GGMLQuantizationType[kind.upper()]
    w = gguf_dequantize(blocks, qtype).reshape(n, k).astype(np.float64)
    offsets = gguf_dequantize(offsets_only(blocks, kind), qtype).reshape(n, k).astype(np.float64)
    return blocks, w, offsets


def quantized_x(x: np.ndarray, kind: str) -> np.ndarray:
    """x [m, k] as the kernel rounds it, back in float64: d * q per group of a block's length."""
    groups = x.astype(np.float32).reshape(x.shape[0], -1, quantized.BLOCK_WEIGHTS[kind])
    top = np.abs(groups).max(axis=2, keepdims=True)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(groups * inverse).astype(np.int32)
    assert np.abs(q).max() <= 127
    d = (top / np.float32(127)).astype(np.float32)
    return (d.astype(np.float64) * q).reshape(x.shape)


def _x(m: int, k: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1, 32:64] = 0.0  # a group of zeros: scale 0, values 0
    return x


def assert_int8_reference(
    got: torch.Tensor, x: np.ndarray, kind: str, w: np.ndarray, offsets: np.ndarray
) -> None:
    xq = quantized_x(x, kind)
    expected = xq @ w.T
    magnitude = np.abs(xq) @ (np.abs(w - offsets) + np.abs(offsets)).T
    error = np.abs(got.double().numpy() - expected)
    worst = float((error / np.maximum(magnitude, 1e-30)).max())
    assert (error <= RTOL * magnitude).all(), f"error up to {worst:.2e} of the terms' magnitude"


@pytest.mark.parametrize("kind", INTEGER_KINDS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_every_kind_on_8_bit_activations(int8_path, kind, m):
    if m > max_rows(kind):
        pytest.skip(f"{kind} takes int8 for up to {max_rows(kind)} rows")
    k = _kind_k(kind)
    blocks, w, offsets = _weights(kind, 19, k)
    x = _x(m, k)
    got = int8_path.quantized_linear(torch.from_numpy(x), torch.from_numpy(blocks), kind)
    assert got.shape == (m, 19)
    assert_int8_reference(got, x, kind, w, offsets)


@pytest.mark.parametrize("kind", ["q8_0", "q4_k", "q6_k"])
def test_long_rows_and_large_values(int8_path, kind):
    """K = 2048 with values far from 1 (x up to ~1e3): scales, not values, carry the range."""
    blocks, w, offsets = _weights(kind, 7, 2048, seed=3)
    x = _x(2, 2048, seed=4) * np.float32(300)
    got = int8_path.quantized_linear(torch.from_numpy(x), torch.from_numpy(blocks), kind)
    assert_int8_reference(got, x, kind, w, offsets)


@pytest.mark.parametrize("kind", INTEGER_KINDS)
def test_the_paths_agree(native, kind):
    """Every integer path gives the same outputs up to float32 summation order."""
    k = _kind_k(kind)
    blocks, w, _ = _weights(kind, 23, k, seed=5)
    x = torch.from_numpy(_x(3, k, seed=6))
    native.set_activation_dtype("int8")
    results = {}
    try:
        paths = ["scalar", *(["avx2"] if native.avx2_supported() else [])]
        paths += ["avx512"] if isa.avx512_runs(native) else []
        for path in paths:
            native.set_isa(path)
            results[path] = native.quantized_linear(x, torch.from_numpy(blocks), kind)
    finally:
        native.set_activation_dtype("float32")
        isa.apply_isa(native)
    scale = float((x.abs().double() @ torch.from_numpy(np.abs(w)).t()).max())
    for path, got in results.items():
        assert (got - results["scalar"]).abs().max() <= 1e-5 * scale, path


@pytest.mark.parametrize("kind", ["q4_k", "q4_1"])
def test_beyond_the_row_limit_and_half_kinds_stay_float32(native, kind):
    k = _kind_k(kind)
    blocks, _, _ = _weights(kind, 11, k)
    x = torch.from_numpy(_x(max_rows(kind) + 1, k))
    half = torch.from_numpy(random_blocks("f16", 11, k))
    float32 = native.quantized_linear(x, torch.from_numpy(blocks), kind)
    float32_half = native.quantized_linear(x[:2], half, "f16")
    native.set_activation_dtype("int8")
    try:
        assert torch.equal(native.quantized_linear(x, torch.from_numpy(blocks), kind), float32)
        assert torch.equal(native.quantized_linear(x[:2], half, "f16"), float32_half)
        assert not torch.equal(
            native.quantized_linear(x[:-1], torch.from_numpy(blocks), kind), float32[:-1]
        )
    finally:
        native.set_activation_dtype("float32")


@pytest.mark.parametrize("kind", ["q8_0", "q4_k"])
def test_rounding_x_costs_what_8_bits_a_group_allow(native, kind):
    """Against float32 activations, the error is x's rounding error (half a step, d / 2, per
    value) times the weights: within a few times its expected size over the row."""
    k = _kind_k(kind)
    blocks, w, _ = _weights(kind, 31, k, seed=7)
    x = _x(1, k, seed=8)
    exact = native.quantized_linear(torch.from_numpy(x), torch.from_numpy(blocks), kind)
    native.set_activation_dtype("int8")
    try:
        rounded = native.quantized_linear(torch.from_numpy(x), torch.from_numpy(blocks), kind)
    finally:
        native.set_activation_dtype("float32")
    group = quantized.BLOCK_WEIGHTS[kind]
    step = np.abs(x.reshape(-1, group)).max(axis=1).repeat(group) / 127
    bound = 4 * np.sqrt(((step / 2) ** 2 / 3) @ (w**2).T)  # 4 sigma of uniform rounding
    assert (np.abs((rounded - exact).double().numpy()[0]) <= bound).all()


def test_activation_dtype_is_one_choice_per_process(native):
    assert isa.resolved_activation_dtype("auto") == "float32"
    with pytest.raises(ValueError, match="activation_dtype 'int4'"):
        isa.resolved_activation_dtype("int4")
    try:
        assert kernels.set_activation_dtype("int8") == "int8"
        assert native.activation_dtype() == "int8"  # a module loaded before is given it
    finally:
        kernels.set_activation_dtype("float32")
    assert native.activation_dtype() == "float32"
