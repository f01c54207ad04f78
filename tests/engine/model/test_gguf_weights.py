"""The bundled GGUF's quantized matrices, read block for block under Hugging Face names, equal
transformers' fp32 conversion of the same file bit for bit once dequantized: query and key rows
back in Hugging Face's order, every layer's seven matrices and the tied embedding there."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

from engine.model.gguf_cache import bundled_gguf_path
from engine.model.gguf_weights import KINDS, read_quantized
from tests.support.fp32_image import transformers_image

pytestmark = pytest.mark.slow
KIND_TYPES = {kind: qtype for qtype, kind in KINDS.items()}


@pytest.fixture(scope="module")
def image():
    return transformers_image(bundled_gguf_path())


def test_every_quantized_matrix_is_the_fp32_image(bundled_loaded, image):
    matrices = read_quantized(bundled_gguf_path(), bundled_loaded.hf_config)
    layers = bundled_loaded.hf_config.num_hidden_layers
    assert len(matrices) == 7 * layers + 1  # tied embedding: no separate output matrix
    assert {m.kind for m in matrices.values()} == {"q4_1", "q8_0"}
    for name, matrix in matrices.items():
        reference = image[name].numpy()
        assert (matrix.rows, matrix.cols) == reference.shape, name
        dequantized = quants.dequantize(matrix.blocks, KIND_TYPES[matrix.kind])
        np.testing.assert_array_equal(dequantized, reference, err_msg=name)


def test_query_and_key_rows_need_their_order_restored(image):
    """Without the row permutation the query matrix would not be the checkpoint's."""
    from gguf import GGUFReader

    reader = GGUFReader(str(bundled_gguf_path()))
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    as_stored = quants.dequantize(np.asarray(raw.data), raw.tensor_type)
    reference = image["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(as_stored, reference)
