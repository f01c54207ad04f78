"""Quantized linear layers on GGUF blocks (every kind) against gguf's own numpy dequantization:
odd shapes, every native path this CPU runs (AVX-512, AVX2 and the portable scalar code), the
torch fallback, and real blocks of the bundled model. A kernel that does not compile fails here
(only a missing toolchain may skip, and not in CI).

Tolerance: every path adds float32 products in an order of its own. A float32 sum of K terms is
off from the exact sum by at most about K * 2**-24 times the sum of the terms' magnitudes (3.4e-5
for K = 576) and in practice by a few sqrt(K) * 2**-24 (1.4e-6 for K = 576); RTOL = 1e-5 of that
magnitude lies between the two. The expected values are computed in float64. The terms are
x_k * w_k, and for kinds with offsets (where the single-row path computes
scale * dot(x, q) + offset * sum(x)) the magnitudes of x_k * scale * q_k and x_k * offset are
counted separately.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine import kernels
from engine.kernels import isa, quantized
from engine.kernels.quantized import QuantizedWeight
from tests.support.gguf_blocks import offsets_only, random_blocks
from tests.support.prerequisites import require

RTOL = 1e-5
ALL_KINDS = sorted(quantized.BLOCK_BYTES)
GGML_TYPES = {kind: GGMLQuantizationType[kind.upper()] for kind in ALL_KINDS}
KINDS = ["q4_1", "q8_0"]  # the kinds the shape-by-shape tests run (through quantize)


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    """``quantized_linear`` with the native module (AVX2 where the CPU has it) or without one."""
    module = request.getfixturevalue("native") if request.param == "native" else None
    monkeypatch.setattr(quantized, "quantized_kernels", lambda: module)
    return request.param


def _random_weight(n: int, k: int, kind: str, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05 + 0.01  # off-centre: Q4_1 mins matter
    return quantized.quantize(weight, kind)


def _random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


def _reference_weights(weight: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """gguf's dequantized weights ``[n, k]`` and each weight's offset (its block minimum, or
    -dmin * m_j; 0 for kinds without)."""
    blocks = weight.blocks.numpy()
    qtype = GGML_TYPES[weight.kind]
    dequantized = gguf_dequantize(blocks, qtype).reshape(weight.n, -1)
    offsets = gguf_dequantize(offsets_only(blocks, weight.kind), qtype).reshape(weight.n, -1)
    return dequantized[:, : weight.k].astype(np.float64), offsets[:, : weight.k].astype(np.float64)


def _random_blocks_weight(kind: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return quantized.from_gguf_blocks(random_blocks(kind, n, k, seed), kind, n, k)


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    """``got`` equals ``x @ w.T`` (float64, gguf's dequantization) within RTOL of the sum of the
    terms' magnitudes."""
    w, minima = _reference_weights(weight)
    x64 = x.reshape(-1, weight.k).double().numpy()
    expected = x64 @ w.T
    magnitude = np.abs(x64) @ (np.abs(w - minima) + np.abs(minima)).T
    error = np.abs(got.reshape(expected.shape).double().numpy() - expected)
    worst = float((error / np.maximum(magnitude, 1e-30)).max())
    assert got.dtype == torch.float32
    assert (error <= RTOL * magnitude).all(), f"error up to {worst:.2e} of the terms' magnitude"


def _padded(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    return F.pad(x, (0, weight.padded_k - weight.k))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3, 17, 37])
@pytest.mark.parametrize("k", [40, 70, 576])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 33])
def test_native_kernel_matches_reference(native_path, kind, n, k, m):
    weight = _random_weight(n, k, kind)
    x = _random_x(m, k)
    got = native_path.quantized_linear(_padded(x, weight), weight.blocks, kind)
    assert got.shape == (m, n)
    assert_matches_reference(got, x, weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [800, 1536])  # long rows: K is cut into segments when M > 1
@pytest.mark.parametrize("m", [1, 2, 9, 33])
def test_native_kernel_on_long_rows(native_path, kind, k, m):
    weight = _random_weight(19, k, kind)
    x = _random_x(m, k)
    got = native_path.quantized_linear(_padded(x, weight), weight.blocks, kind)
    assert_matches_reference(got, x, weight)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 5, quantized.NATIVE_MAX_ROWS, quantized.NATIVE_MAX_ROWS + 1, 70])
def test_quantized_linear_matches_reference(backend, kind, m):
    weight = _random_weight(37, 70, kind)
    x = _random_x(m, 70)
    assert_matches_reference(quantized.quantized_linear(x, weight), x, weight)


@pytest.mark.parametrize("kind", KINDS)
def test_large_inputs_dequantize_a_tile_at_a_time(backend, kind, monkeypatch):
    monkeypatch.setattr(quantized, "_TILE_FLOATS", 5 * 96)  # 5 rows of 96 per tile
    weight = _random_weight(23, 70, kind)
    x = _random_x(quantized.NATIVE_MAX_ROWS + 3, 70)
    assert_matches_reference(quantized.quantized_linear(x, weight), x, weight)


@pytest.mark.parametrize("kind", KINDS)
def test_leading_dimensions_and_strided_inputs(backend, kind):
    weight = _random_weight(17, 40, kind)
    x = _random_x(6, 80)[:, ::2].reshape(2, 3, 40)  # not contiguous
    got = quantized.quantized_linear(x, weight)
    assert got.shape == (2, 3, 17)
    assert_matches_reference(got, x, weight)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_bit_exact(backend, native_path, kind):
    weight = _random_weight(37, 70, kind)
    expected, _ = _reference_weights(weight)
    got = weight.dequantize()
    assert got.shape == (37, 70) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_pads_rows_with_zeros(kind):
    weight = torch.randn(5, 70, generator=torch.Generator().manual_seed(2))
    quantized_weight = quantized.quantize(weight, kind)
    padded = F.pad(weight, (0, 26)).numpy()
    assert (quantized_weight.n, quantized_weight.k, quantized_weight.padded_k) == (5, 70, 96)
    np.testing.assert_array_equal(
        quantized_weight.blocks.numpy(), gguf_quantize(padded, GGML_TYPES[kind])
    )


def _kind_k(kind: str) -> int:
    """A row length of a few blocks of ``kind``."""
    return 512 if quantized.BLOCK_WEIGHTS[kind] == 256 else 96


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_kind_dequantizes_as_gguf_does(native_path, kind):
    weight = _random_blocks_weight(kind, 11, _kind_k(kind))
    expected, _ = _reference_weights(weight)
    got = native_path.dequantize(weight.blocks, kind)
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("m", [1, 3, 8, 17, 32])
def test_every_kind_on_the_native_kernel(native_path, kind, m):
    weight = _random_blocks_weight(kind, 19, _kind_k(kind))
    x = _random_x(m, weight.k)
    assert_matches_reference(native_path.quantized_linear(x, weight.blocks, kind), x, weight)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_kind_on_the_tiled_path(native_path, backend, kind, monkeypatch):
    monkeypatch.setattr(quantized, "_TILE_FLOATS", 5 * 512)  # a few rows per tile
    weight = _random_blocks_weight(kind, 23, _kind_k(kind))
    x = _random_x(40, weight.k)
    assert_matches_reference(quantized.quantized_linear(x, weight), x, weight)
    np.testing.assert_array_equal(
        weight.dequantize().numpy(), _reference_weights(weight)[0].astype(np.float32)
    )


@pytest.mark.parametrize("whole", [True, False], ids=["one-tile", "tiles"])
def test_prompts_multiplied_in_bfloat16(native, whole, monkeypatch):
    """bfloat16 on the tiled path: x and each tile rounded to bfloat16, products stored from
    bfloat16: within bfloat16's rounding (2**-8 relative, a few times over a 256-term sum) of
    float32, float32 out; the native rows (decode steps) stay float32 and exact."""
    if not whole:
        monkeypatch.setattr(quantized, "_TILE_FLOATS", 5 * 512)
    weight = _random_blocks_weight("q4_k", 23, 256)
    x = _random_x(40, weight.k)
    exact = quantized.quantized_linear(x, weight)
    rounded = quantized.quantized_linear(x, weight, torch.bfloat16)
    assert rounded.dtype == torch.float32 and not torch.equal(rounded, exact)
    scale = (x.abs() @ weight.dequantize().abs().t()).max()
    assert (rounded - exact).abs().max() <= 2**-6 * scale
    decode_rows = x[:8]
    assert torch.equal(
        quantized.quantized_linear(decode_rows, weight, torch.bfloat16),
        quantized.quantized_linear(decode_rows, weight),
    )


@pytest.mark.parametrize("kind", quantized.QUANTIZABLE)
@pytest.mark.parametrize("m", [1, 9])
def test_quantizable_kinds_through_quantize(native_path, kind, m):
    weight = _random_weight(13, 70, kind)
    x = _random_x(m, 70)
    assert_matches_reference(quantized.quantized_linear(x, weight), x, weight)


@pytest.fixture(scope="module")
def bundled_gguf() -> GGUFReader:
    from engine.errors import ModelLoadError
    from engine.model.gguf_cache import bundled_gguf_path

    try:
        path = bundled_gguf_path()
    except ModelLoadError as exc:
        require(False, f"the bundled model ({exc})")
    return GGUFReader(path)


def _bundled_weight(reader: GGUFReader, name: str, kind: str, row_step: int) -> QuantizedWeight:
    (tensor,) = [t for t in reader.tensors if t.name == name]
    assert tensor.tensor_type == GGML_TYPES[kind], f"{name} is {tensor.tensor_type.name}"
    data = tensor.data[::row_step]
    return quantized.from_gguf_blocks(data, kind, n=data.shape[0], k=int(tensor.shape[0]))


@pytest.mark.parametrize(
    "name, kind, row_step",
    [("blk.0.ffn_gate.weight", "q4_1", 1), ("token_embd.weight", "q8_0", 16)],
)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_bundled_model_blocks(native_path, bundled_gguf, name, kind, row_step, m):
    weight = _bundled_weight(bundled_gguf, name, kind, row_step)
    assert weight.k == 576
    x = _random_x(m, weight.k)
    got = native_path.quantized_linear(x, weight.blocks, kind)
    assert_matches_reference(got, x, weight)


def test_bundled_blocks_are_read_as_gguf_reads_them(native, bundled_gguf):
    weight = _bundled_weight(bundled_gguf, "blk.0.ffn_gate.weight", "q4_1", 1)
    assert tuple(weight.blocks.shape) == (1536, 360) and weight.n == 1536
    (tensor,) = [t for t in bundled_gguf.tensors if t.name == "blk.0.ffn_gate.weight"]
    expected = gguf_dequantize(tensor.data, GGMLQuantizationType.Q4_1)
    np.testing.assert_array_equal(native.dequantize(weight.blocks, "q4_1").numpy(), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_thread_count_does_not_change_results(native, kind):
    weight = _random_weight(301, 576, kind)
    x = _random_x(9, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = native.quantized_linear(x, weight.blocks, kind)
        torch.set_num_threads(2)
        several = native.quantized_linear(x, weight.blocks, kind)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single, several)


def test_isa_choices(native):
    native.set_isa("scalar")
    assert native.isa() == "scalar"
    native.set_isa("auto")  # never AVX-512 by itself
    assert native.isa() == ("avx2" if native.avx2_supported() else "scalar")
    if native.avx512_supported():
        native.set_isa("avx512")
        assert native.isa() == "avx512"
    with pytest.raises(RuntimeError, match="'auto', 'avx512', 'avx2' or 'scalar'"):
        native.set_isa("sse2")
    isa.apply_isa(native)


def test_the_load_gives_the_probed_isa(native, monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    expected = "avx512" if isa.avx512_runs(native) else native.isa()
    assert isa.apply_isa(native) in (expected, "avx2", "scalar")
    assert isa.chosen_isa(native) == ("avx512" if isa.avx512_runs(native) else "auto")
    monkeypatch.setenv(isa.ISA_ENV, "scalar")
    assert isa.apply_isa(native) == "scalar"
    monkeypatch.setenv(isa.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match=isa.ISA_ENV):
        isa.chosen_isa(native)
    monkeypatch.delenv(isa.ISA_ENV)
    isa.apply_isa(native)


class _FaultingProbe:
    """A module whose cpuid lists AVX-512 but whose probe dies as a faulting CPU would."""

    def avx512_supported(self) -> bool:
        return True

    def avx512_probe(self) -> bool:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGILL)
        return True


def test_a_probe_that_faults_kills_only_the_child(monkeypatch):
    monkeypatch.setattr(isa, "_avx512_runs", None)
    assert isa.avx512_runs(_FaultingProbe()) is False  # and this process lives on
    monkeypatch.setattr(isa, "_avx512_runs", None)


def test_mismatched_shapes_are_refused(native):
    weight = _random_weight(3, 64, "q8_0")
    with pytest.raises(ValueError, match=r"float32 \[\.\.\., 64\]"):
        quantized.quantized_linear(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match=r"uint8 \[3, 68\]"):
        QuantizedWeight(weight.blocks[:, :34], "q8_0", 3, 64)
    with pytest.raises(ValueError, match="cannot quantize"):
        quantized.quantize(torch.zeros(3, 256), "q4_k")
    with pytest.raises(ValueError, match="unknown kind"):
        QuantizedWeight(weight.blocks, "q3_k", 3, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(torch.zeros(3, 144, dtype=torch.uint8), "q4_k", 3, 192)
    with pytest.raises(RuntimeError, match="features"):
        native.quantized_linear(torch.zeros(2, 32), weight.blocks, "q8_0")
    with pytest.raises(RuntimeError, match="whole q4_1 blocks"):
        native.quantized_linear(torch.zeros(2, 64), weight.blocks, "q4_1")


@pytest.fixture
def fresh_kernels(monkeypatch):
    """``quantized_kernels`` run anew with the environment's choice removed, then forgotten."""
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    quantized.quantized_kernels.cache_clear()
    yield quantized.quantized_kernels
    quantized.quantized_kernels.cache_clear()


def test_disabled_kernels_fall_back_to_torch(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    with caplog.at_level("INFO", logger=quantized.__name__):
        assert fresh_kernels() is None
    assert "quantized linear: torch fallback (native kernel disabled" in caplog.text


def test_a_build_error_raises_instead_of_falling_back(fresh_kernels, monkeypatch):
    def broken(source):
        raise RuntimeError("Error building extension 'pdserve_quantized_linear_cpu'")

    monkeypatch.setattr(kernels, "missing_toolchain", lambda: None)
    monkeypatch.setattr(kernels, "build_extension", broken)
    with pytest.raises(kernels.KernelBuildError, match="quantized_linear_cpu.cpp failed to build"):
        fresh_kernels()


def test_only_a_missing_toolchain_falls_back(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "missing_toolchain", lambda: "ninja")
    with caplog.at_level("WARNING", logger=quantized.__name__):
        assert fresh_kernels() is None
    assert "quantized linear: torch fallback (no native kernel: missing ninja)" in caplog.text


def test_the_toolchain_builds_the_kernel_the_wrapper_uses(native, fresh_kernels):
    module = fresh_kernels()
    assert module is not None and module.__file__ == native.__file__
