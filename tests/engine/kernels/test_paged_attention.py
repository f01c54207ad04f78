"""The native CPU decode kernel against the plain torch path, on random paged caches; a kernel that
does not compile fails here (only a missing toolchain may skip, and not in CI)."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.model.forward_batch import ForwardBatch
from engine.model.paged_attention import _decode_attention, _native_decode
from tests.support.prerequisites import require


@pytest.fixture(scope="module")
def native():
    missing = kernels.missing_toolchain()
    require(missing is None, f"{missing}: the native kernel cannot be built here")
    return kernels.build_extension(kernels.SOURCE)  # a compile error fails every test that uses it


def _batch(context_lens: list[int], block_size: int, num_blocks: int) -> ForwardBatch:
    gen = torch.Generator().manual_seed(3)
    max_blocks = max(-(-n // block_size) for n in context_lens)
    tables = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks]
    return ForwardBatch(
        input_ids=torch.zeros(len(context_lens), dtype=torch.long),
        positions=torch.zeros(len(context_lens), dtype=torch.long),
        slot_mapping=torch.zeros(len(context_lens), dtype=torch.long),
        num_decode_tokens=len(context_lens),
        decode_block_tables=tables.view(len(context_lens), max_blocks),
        decode_context_lens=torch.tensor(context_lens),
        decode_max_context_len=max(context_lens),
        prefill_seqs=[],
        logits_indices=torch.arange(len(context_lens)),
    )


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 12)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_native_decode_matches_torch(native, heads, kv_heads, head_dim, block_size):
    context_lens = [1, 5, 17, 40, 3]
    batch = _batch(context_lens, block_size, num_blocks=256)
    cache = torch.randn(2, 256, block_size, kv_heads, head_dim)
    q = torch.randn(len(context_lens), heads, head_dim)
    expected = _decode_attention(q, cache, batch, head_dim**-0.5)
    got = _native_decode(native, q, cache, batch, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 12)])
def test_native_decode_reads_16_bit_pages_as_torch_widens_them(
    native, dtype, heads, kv_heads, head_dim
):
    """A 16-bit cache is read widened to float32: the same sums as a float32 cache holding the
    rounded values (head_dim 12 takes the scalar tail of the widening loads)."""
    context_lens = [1, 7, 33, 2]
    batch = _batch(context_lens, block_size=4, num_blocks=64)
    cache = torch.randn(2, 64, 4, kv_heads, head_dim).to(dtype)
    q = torch.randn(len(context_lens), heads, head_dim)
    expected = _native_decode(native, q, cache.float(), batch, 0.125)
    torch.testing.assert_close(
        _native_decode(native, q, cache, batch, 0.125), expected, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        _decode_attention(q, cache, batch, 0.125), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rows_are_stored_rounded_as_torch_rounds_them(native, dtype):
    """The kernels' stores (8 lanes at a time, a scalar tail) give torch's conversion bit for bit:
    ties to even, values past the range, subnormals, infinities and NaN."""
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(64, 67, generator=gen) * torch.logspace(-9, 6, 67)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65520.0, 7e4])
    values[0, : ties.numel()] = ties
    values[1, :8] = torch.tensor([float("inf"), -float("inf"), 1e-8, -1e-6, 0.0, -0.0, 3e38, 1])
    values[2, 3] = values[3, 60] = float("nan")
    out = torch.empty(values.shape, dtype=dtype)
    native.store_rows(values, out)
    expected = values.to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))


def test_native_decode_refuses_a_cache_of_another_dtype(native):
    batch = _batch([3], block_size=4, num_blocks=8)
    cache = torch.zeros(2, 8, 4, 1, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        _native_decode(native, torch.zeros(1, 1, 8), cache, batch, 1.0)


@pytest.fixture
def fresh_kernels(monkeypatch):
    """``cpu_kernels`` run anew with the environment's choice removed, and forgotten afterwards."""
    monkeypatch.delenv(kernels.DISABLE_ENV, raising=False)
    kernels.cpu_kernels.cache_clear()
    yield kernels.cpu_kernels
    kernels.cpu_kernels.cache_clear()


def test_a_build_error_raises_instead_of_falling_back(fresh_kernels, monkeypatch):
    def broken(source):
        raise RuntimeError("Error building extension 'pdserve_paged_attention_cpu'")

    monkeypatch.setattr(kernels, "missing_toolchain", lambda: None)
    monkeypatch.setattr(kernels, "build_extension", broken)
    with pytest.raises(kernels.KernelBuildError, match="paged_attention_cpu.cpp failed to build"):
        fresh_kernels()


def test_only_a_missing_toolchain_falls_back(fresh_kernels, monkeypatch, caplog):
    monkeypatch.setattr(kernels, "missing_toolchain", lambda: "ninja")
    with caplog.at_level("WARNING", logger=kernels.__name__):
        assert fresh_kernels() is None
    assert "attention: torch fallback (no native kernel: missing ninja)" in caplog.text


def test_the_engine_gets_the_kernel_the_toolchain_builds(native, fresh_kernels):
    assert fresh_kernels() is native
