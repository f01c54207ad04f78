"""A GGUF that mixes every block format a K-quant download does (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1,
Q4_0, Q8_0, F16, BF16, and Q3_K, which has no kernel), written here with random but valid
blocks: pdserve loads it, ``weight_dtype: auto`` keeps each matrix in its own format (parts of
one projection included), names them in ``weight_formats``, logs the format it dequantized, and
answers token for token as the file's fp32 image does."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from benchmarks.llamacpp.random_gguf import PRESETS, tensor_shapes, write_header
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from tests.support.gguf_blocks import random_blocks

SHAPE = replace(PRESETS["tiny"], hidden_size=256, intermediate_size=512, num_heads=4)
# Each layer's matrices, as llama-quantize would mix them (v and down with more bits).
LAYER_FORMATS = [
    {"attn_q": "q4_k", "attn_k": "q4_k", "attn_v": "q6_k", "attn_output": "q5_k",
     "ffn_gate": "q4_k", "ffn_up": "q4_k", "ffn_down": "q6_k"},
    {"attn_q": "q5_0", "attn_k": "q5_0", "attn_v": "q8_0", "attn_output": "q4_0",
     "ffn_gate": "q5_1", "ffn_up": "bf16", "ffn_down": "Q3_K"},
]  # fmt: skip
EMBEDDING_FORMAT = "f16"
Q3_K_SCALE_OFFSET = 108  # its fp16 d follows 32 bytes of high bits, 64 of quants, 12 of scales


def _blocks(kind: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, GGMLQuantizationType]:
    if kind == "Q3_K":  # no kernel: random bytes with a finite, small scale
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (rows, cols // 256, 110), dtype=np.uint8)
        d = rng.uniform(1e-4, 1e-3, (rows, cols // 256)).astype(np.float16)
        blocks[..., Q3_K_SCALE_OFFSET:] = d.view(np.uint8).reshape(rows, cols // 256, 2)
        return blocks.reshape(rows, -1), GGMLQuantizationType.Q3_K
    blocks = random_blocks(kind, rows, cols, seed=seed, scales=(1e-4, 1e-3))
    return blocks, GGMLQuantizationType[kind.upper()]


@pytest.fixture(scope="module")
def mixed_loaded(tmp_path_factory):
    """The file written and loaded once (its fp32 conversion in a cache folder of its own)."""
    folder = tmp_path_factory.mktemp("gguf-formats")
    path = folder / "mixed.gguf"
    writer = GGUFWriter(path, SHAPE.arch)
    write_header(writer, "mixed", SHAPE)
    for seed, (name, dims) in enumerate(tensor_shapes(SHAPE)):
        if len(dims) == 1:  # norms
            writer.add_tensor(name, np.ones(dims, dtype=np.float32))
            continue
        part = name.split(".")[-2]
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        kind = EMBEDDING_FORMAT if layer is None else LAYER_FORMATS[layer][part]
        blocks, qtype = _blocks(kind, dims[0], dims[1], seed)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PDSERVE_CACHE_DIR", str(folder / "cache"))
        yield load_model(str(path))


def _engine(loaded, weight_dtype: str) -> LLMEngine:
    config = EngineConfig(
        device="cpu", weight_dtype=weight_dtype, cache=CacheConfig(block_size=16, num_blocks=64)
    )
    return LLMEngine(config, loaded)


def test_every_matrix_keeps_its_format_and_answers_as_the_fp32_image(mixed_loaded, caplog):
    loaded = mixed_loaded
    with caplog.at_level(logging.WARNING, logger="engine.model.gguf_weights"):
        auto = _engine(loaded, "auto")
    assert "1 Q3_K matrices have no kernel" in caplog.text
    assert auto.model.weight_formats() == {
        "embedding": "f16",
        "qkv": "q4_k+q6_k | q5_0+q8_0",
        "o_proj": "q5_k | q4_0",
        "gate_up": "q4_k | q5_1+bf16",
        "down": "q6_k | float32",
        "lm_head": "f16",
    }
    assert auto.model.fused is not None  # parts and all, the decode step runs fused
    fp32 = _engine(loaded, "fp32")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 300, 42], [7, 7, 7]]
    answers = auto.generate(prompts, params)
    assert answers == fp32.generate(prompts, params)
    assert all(len(set(answer)) > 3 for answer in answers), answers  # not one repeated token


def test_the_embedding_rows_come_from_the_blocks(mixed_loaded):
    loaded = mixed_loaded
    auto = _engine(loaded, "auto")
    ids = torch.tensor([0, 5, 319, 5])
    expected = loaded.weights["model.embed_tokens.weight"][ids]
    assert torch.equal(auto.model.embed(ids), expected)
