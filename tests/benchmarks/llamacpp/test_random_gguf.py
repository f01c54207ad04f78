"""``benchmarks/llamacpp/random_gguf.py``'s files: gguf-py reads back the shapes and header
written, the synthetic vocabulary is GPT-2's byte alphabet plus merges, and pdserve's loader
(through its
transformers conversion) and engine take a ``tiny`` file of either architecture."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from benchmarks.llamacpp.random_gguf import PRESETS, random_gguf_path, tiny_shape, write_random_gguf
from benchmarks.llamacpp.synthetic_vocab import byte_alphabet, synthetic_vocab
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(params=["llama", "qwen2"])
def tiny_file(request, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    shape = tiny_shape(request.param)
    return write_random_gguf(tmp_path / f"tiny-{request.param}.gguf", "tiny", shape), shape


def test_the_header_and_shapes_read_back(tiny_file):
    path, shape = tiny_file
    reader = GGUFReader(str(path))
    arch = shape.arch
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, f"{arch}.block_count") == shape.num_layers
    assert _field(reader, f"{arch}.attention.head_count_kv") == shape.num_kv_heads
    assert _field(reader, f"{arch}.rope.freq_base") == shape.rope_theta
    assert len(_field(reader, "tokenizer.ggml.tokens")) == shape.vocab_size
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    assert "output.weight" not in tensors  # tied embeddings
    assert list(tensors["token_embd.weight"].shape) == [shape.hidden_size, shape.vocab_size]
    assert list(tensors["blk.1.attn_k.weight"].shape) == [shape.hidden_size, 2 * shape.head_dim]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [shape.intermediate_size, 64]
    assert ("blk.0.attn_q.bias" in tensors) == (arch == "qwen2")
    weights = np.asarray(tensors["blk.0.ffn_up.weight"].data, dtype=np.float32)
    assert tensors["blk.0.ffn_up.weight"].tensor_type.name == "F16"
    assert 0.015 < weights.std() < 0.025 and np.all(tensors["blk.0.attn_norm.weight"].data == 1)


def test_pdserve_loads_and_runs_it(tiny_file):
    path, shape = tiny_file
    loaded = load_model(str(path))
    assert loaded.hf_config.model_type == shape.arch and loaded.hf_config.tie_word_embeddings
    assert len(loaded.tokenizer) == shape.vocab_size
    assert ("model.layers.0.self_attn.q_proj.bias" in loaded.weights) == (shape.arch == "qwen2")
    engine = LLMEngine(EngineConfig(device="cpu"), loaded)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    (output,) = engine.generate([[5, 17, 300]], params)
    assert len(output) == 4


def test_the_vocabulary_is_byte_level_bpe():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    assert byte_alphabet() == [spelling[byte] for byte in range(256)]
    vocab = synthetic_vocab(70_000)
    assert len(vocab.tokens) == len(set(vocab.tokens)) == 70_000
    assert vocab.merges[0] == f"{spelling[0]} {spelling[0]}"
    assert all(left + right in vocab.tokens[256:] for left, right in (vocab.merges[-1].split(),))
    assert vocab.token_types[-2:] == [3, 3] and vocab.eos_token_id == 69_999


def test_presets_have_the_real_models_shapes(tmp_path):
    assert (PRESETS["0.5b"].head_dim, PRESETS["1b"].head_dim) == (64, 64)
    assert (PRESETS["3b"].head_dim, PRESETS["3b"].num_layers) == (128, 28)  # Llama-3.2-3B
    assert PRESETS["0.5b"].qkv_bias and not PRESETS["1b"].qkv_bias
    with pytest.raises(ValueError, match="preset"):
        random_gguf_path("7b", tmp_path)
