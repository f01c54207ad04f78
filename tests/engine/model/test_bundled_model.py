"""The bundled SmolLM2-135M-Instruct: greedy output identical to transformers ``generate``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.gguf_cache import converted_dir_for
from engine.sampling_params import SamplingParams
from tests.support.bundled_chat import (
    MESSAGES,
)

pytestmark = pytest.mark.slow


def test_bundled_config_is_smollm2(bundled_loaded):
    cfg = bundled_loaded.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (576, 30, 9)
    assert cfg.num_key_value_heads == 3 and cfg.vocab_size == 49152
    assert bundled_loaded.tokenizer.eos_token == "<|im_end|>"
    assert bundled_loaded.tokenizer.chat_template


def test_greedy_identical_to_transformers_generate(bundled_loaded):
    tokenizer = bundled_loaded.tokenizer
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for m in MESSAGES
    ]
    config = EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="float32")
    engine = LLMEngine(config, bundled_loaded)
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=32))
    # transformers' own float32 image of the file (the engine reads the file as it is)
    hf_dir = converted_dir_for(bundled_loaded.gguf_path)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert tokens == ref[0, len(prompt) :].tolist(), tokenizer.decode(prompt)


def test_chinese_streams_whole_characters(bundled_loaded):
    tokenizer = bundled_loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": MESSAGES[1]}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32"), bundled_loaded)
    engine.add_request(engine.request("zh", list(prompt), SamplingParams(max_new_tokens=40)))
    pieces = []
    while engine.has_work():
        pieces += [e.text for e in engine.step()]
    text = "".join(pieces)
    assert all("\ufffd" not in piece for piece in pieces)
    assert sum("\u4e00" <= ch <= "\u9fff" for ch in text) >= 5
