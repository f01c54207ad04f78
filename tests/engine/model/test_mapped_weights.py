"""A GGUF's matrices are computed from the mapped file's own pages where they can be (one matrix,
or matrices a converter wrote one after another): no copy, so every process mapping the file
shares them. Matrices elsewhere in the file are stacked into a copy, with the same products."""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.quantized import quantized_linear
from engine.model.gguf_index import read_index
from engine.model.gguf_weights import GGUFMatrix
from engine.model.linear import from_gguf

ROW_BYTES = 68  # q8_0: 64 inputs a row, two blocks of 34 bytes


def _mapped(tmp_path, rows: int) -> np.ndarray:
    """A file of ``rows`` random q8_0 rows (small scales), mapped as the GGUF reader maps it."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(rows, ROW_BYTES), dtype=np.uint8)
    for block in range(2):  # each block's float16 scale: small and finite
        data[:, block * 34 : block * 34 + 2] = np.full((rows, 1), 0.01, np.float16).view(np.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.tobytes())
    return np.memmap(path, dtype=np.uint8, mode="c").reshape(rows, ROW_BYTES)


def _matrix(blocks: np.ndarray) -> GGUFMatrix:
    return GGUFMatrix("q8_0", blocks.shape[0], 64, blocks)


def _shares(layer, mapped: np.ndarray) -> bool:
    return np.shares_memory(layer.weight.blocks.numpy(), mapped)


def test_one_matrix_and_matrices_in_a_row_are_the_files_own_bytes(tmp_path):
    mapped = _mapped(tmp_path, 12)
    assert _shares(from_gguf([_matrix(mapped[:4])]), mapped)
    gate_up = from_gguf([_matrix(mapped[:4]), _matrix(mapped[4:12])])
    assert _shares(gate_up, mapped) and gate_up.weight.n == 12


def test_matrices_apart_are_stacked_into_a_copy_with_the_same_products(tmp_path):
    mapped = _mapped(tmp_path, 12)
    apart = from_gguf([_matrix(mapped[:4]), _matrix(mapped[8:12])])  # rows 4-8 between them
    assert not _shares(apart, mapped)
    x = torch.randn(3, 64)
    first, second = from_gguf([_matrix(mapped[:4])]), from_gguf([_matrix(mapped[8:12])])
    expected = torch.cat([quantized_linear(x, first.weight), quantized_linear(x, second.weight)], 1)
    torch.testing.assert_close(quantized_linear(x, apart.weight), expected, rtol=0, atol=0)
    in_order = from_gguf([_matrix(mapped[:4]), _matrix(mapped[4:8])])
    copied = from_gguf([_matrix(np.array(mapped[:4])), _matrix(np.array(mapped[4:8]))])
    assert not _shares(copied, mapped)
    torch.testing.assert_close(
        quantized_linear(x, in_order.weight), quantized_linear(x, copied.weight)
    )


def test_the_reader_maps_tensors_writable_without_touching_the_file(tmp_path):
    from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf

    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    before = path.read_bytes()
    tensor = next(t for t in read_index(path).tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.data.flags.writeable  # copy-on-write: torch takes it without a copy
    tensor.data[0, 0] ^= 0xFF  # a write stays in this process
    assert path.read_bytes() == before


def test_released_pages_come_back_from_the_file_on_use(tmp_path):
    from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
    from engine.model.gguf_index import release_resident_pages

    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    tensor = next(t for t in read_index(path).tensors if t.name == "blk.0.ffn_down.weight")
    cols, rows = tensor.shape
    layer = from_gguf([GGUFMatrix("f16", rows, cols, tensor.data.view(np.uint8))])
    assert _shares(layer, tensor.data)  # computed from the map itself
    x = torch.randn(2, cols)
    before = quantized_linear(x, layer.weight)
    release_resident_pages()  # the map's pages leave this process ...
    torch.testing.assert_close(
        quantized_linear(x, layer.weight), before, rtol=0, atol=0
    )  # ... and come back
