"""A GGUF file read as it is: every tensor, dequantized when looked up, equals transformers' fp32
conversion of the file bit for bit (llama's query and key rows back in order, qwen2's biases,
F16 and K-quant blocks alike), and loading the file writes its metadata alone."""

from __future__ import annotations

import pytest
import torch

from benchmarks.llamacpp.random_gguf import tiny_shape, write_random_gguf
from engine.model.gguf_cache import bundled_gguf_path
from engine.model.gguf_model import GGUFTensors, hf_name
from engine.model.loader import load_model
from tests.support.fp32_image import transformers_image


def _assert_is_the_image(weights, image: dict[str, torch.Tensor]) -> None:
    assert sorted(weights) == sorted(image)
    for name, reference in image.items():
        assert torch.equal(weights[name], reference), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_files_tensors_are_transformers_image(tmp_path, arch):
    path = write_random_gguf(tmp_path / f"{arch}.gguf", "tiny", tiny_shape(arch))
    loaded = load_model(str(path))
    assert isinstance(loaded.weights, GGUFTensors) and loaded.gguf_path == path
    _assert_is_the_image(loaded.weights, transformers_image(path))


def test_first_rows_are_read_alone_and_reordered_rows_whole(tmp_path):
    path = write_random_gguf(tmp_path / "tiny.gguf", "tiny", tiny_shape("llama"))
    weights = load_model(str(path)).weights
    table = weights["model.embed_tokens.weight"]
    assert torch.equal(weights.rows("model.embed_tokens.weight", 8), table[:8])
    with pytest.raises(ValueError, match="reordered"):
        weights.rows("model.layers.0.self_attn.q_proj.weight", 8)


def test_tensors_the_engine_does_not_use_have_no_name():
    assert hf_name("rope_freqs.weight") == (None, "")
    norm = ("model.layers.3.input_layernorm.weight", "attn_norm")
    assert hf_name("blk.3.attn_norm.weight") == norm
    assert hf_name("blk.0.attn_k.bias") == ("model.layers.0.self_attn.k_proj.bias", "attn_k")
    assert hf_name("output_norm.weight") == ("model.norm.weight", "output_norm")


@pytest.mark.slow
def test_the_bundled_file_loads_as_it_is(bundled_loaded):
    """Its tensors are transformers' image (Q4_1 and Q8_0 blocks), and the folder made at its
    first start holds its configuration and tokenizer only: no weights, a few MB."""
    gguf = bundled_gguf_path()
    _assert_is_the_image(bundled_loaded.weights, transformers_image(gguf))
    files = [f for f in bundled_loaded.path.iterdir() if f.is_file()]
    assert not [f for f in files if f.suffix in (".safetensors", ".bin")]
    assert sum(f.stat().st_size for f in files) < 0.1 * gguf.stat().st_size
