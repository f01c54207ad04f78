"""Batch invariance of the native quantized kernels: a row of x gives the same bits alone as in
any number of rows (tiles of 8, 4 on 8 lanes, and their remainders), on every kind and every
path this CPU runs, on float32 activations and, with ``set_batch_invariant(True)``, on 8-bit
ones beyond the row counts they otherwise take. Speculative decoding's exactness rests on it: a
drafted token's row must give what a one-token step gives."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import quantized
from tests.support.gguf_blocks import random_blocks

ALL_KINDS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16"]
INTEGER_KINDS = ALL_KINDS[:8]
ROW_COUNTS = [2, 3, 5, 8, 9, 13, 17, 33]


def _case(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    k = 2048 if quantized.BLOCK_WEIGHTS[kind] == 256 else 1056  # long rows, odd block counts
    blocks = torch.from_numpy(random_blocks(kind, 37, k, seed=seed))
    x = torch.randn(max(ROW_COUNTS), k, generator=torch.Generator().manual_seed(seed))
    return blocks, x


def _assert_rows_alone(module, kind: str) -> None:
    blocks, x = _case(kind)
    alone = torch.cat([module.quantized_linear(x[i : i + 1], blocks, kind) for i in range(len(x))])
    for m in ROW_COUNTS:
        together = module.quantized_linear(x[:m], blocks, kind)
        assert torch.equal(together, alone[:m]), f"{kind}: {m} rows differ from each alone"


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_float32_rows_are_summed_alike_in_any_tile(native_path, kind):
    native_path.set_batch_invariant(True)
    try:
        _assert_rows_alone(native_path, kind)
    finally:
        native_path.set_batch_invariant(False)


@pytest.mark.parametrize("kind", ["q4_k", "q8_0", "q4_1"])
def test_without_invariance_only_a_lone_row_is_summed_otherwise(native_path, kind):
    """Invariance off, a step of one row takes the single-row kernel (scales per sub-block);
    rows of larger steps still agree with each other in any tile."""
    blocks, x = _case(kind)
    tiled = native_path.quantized_linear(x, blocks, kind)
    for m in ROW_COUNTS:
        assert torch.equal(native_path.quantized_linear(x[:m], blocks, kind), tiled[:m])
    lone = native_path.quantized_linear(x[:1], blocks, kind)
    torch.testing.assert_close(lone, tiled[:1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", INTEGER_KINDS)
def test_int8_rows_are_invariant_once_asked(native_path, kind):
    native_path.set_activation_dtype("int8")
    native_path.set_batch_invariant(True)
    try:
        _assert_rows_alone(native_path, kind)
    finally:
        native_path.set_activation_dtype("float32")
        native_path.set_batch_invariant(False)


def test_int8_without_invariance_leaves_larger_steps_to_float32(native):
    """The default: beyond int8_max_rows (8 on the K kinds) a step is float32, so a row's
    bits there differ from its 8-bit bits alone; invariance closes exactly that gap."""
    blocks, x = _case("q4_k")
    native.set_activation_dtype("int8")
    try:
        alone = native.quantized_linear(x[:1], blocks, "q4_k")
        assert not torch.equal(native.quantized_linear(x[:9], blocks, "q4_k")[:1], alone)
        native.set_batch_invariant(True)
        assert torch.equal(native.quantized_linear(x[:9], blocks, "q4_k")[:1], alone)
    finally:
        native.set_activation_dtype("float32")
        native.set_batch_invariant(False)
