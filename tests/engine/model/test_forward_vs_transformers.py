"""Our paged forward pass against transformers, on tiny random models of each architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from testbed.tiny_model import build_tiny_model
from tests.conftest import make_engine

PROMPT_LENGTHS = [1, 3, 7, 18, 33]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _capture_logits(engine) -> list[tuple[list[int], torch.Tensor]]:
    """Record (tokens so far, logits) for every sampled row of every step."""
    seen: list[tuple[list[int], torch.Tensor]] = []
    run = engine.runner.run

    def recording_run(scheduled, *hooks):
        logits, samplers = run(scheduled, *hooks)
        seen.extend((list(r.token_ids), logits[i].clone()) for i, r in enumerate(samplers))
        return logits, samplers

    engine.runner.run = recording_run
    return seen


def _check_against_hf(loaded, engine, max_new_tokens: int = 4) -> None:
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    seen = _capture_logits(engine)
    prompts = _prompts(loaded.hf_config.vocab_size)
    engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    assert len(seen) == len(prompts) * max_new_tokens
    for token_ids, ours in seen:
        with torch.no_grad():
            ref = hf(torch.tensor([token_ids])).logits[0, -1]
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"relative logits error {rel:.2e} after {len(token_ids)} tokens"


@pytest.mark.parametrize("max_prefill_tokens", [8192, 5], ids=["whole-prompts", "chunked"])
def test_llama_logits_match_transformers(tiny_loaded, max_prefill_tokens):
    engine = make_engine(
        tiny_loaded, kv_cache_dtype="float32", max_prefill_tokens=max_prefill_tokens
    )
    _check_against_hf(tiny_loaded, engine)


@pytest.mark.parametrize("model_type", ["qwen2", "mistral"])
def test_other_architectures_match_transformers(tmp_path, model_type):
    loaded = load_model(
        str(build_tiny_model(tmp_path, model_type=model_type, initializer_range=0.3))
    )
    _check_against_hf(loaded, make_engine(loaded, kv_cache_dtype="float32", max_prefill_tokens=6))


def test_tied_embeddings_and_block_size_one(tmp_path):
    loaded = load_model(str(build_tiny_model(tmp_path, tie_embeddings=True, initializer_range=0.3)))
    assert "lm_head.weight" not in loaded.weights
    _check_against_hf(
        loaded, make_engine(loaded, kv_cache_dtype="float32", block_size=1, num_blocks=512)
    )


def test_greedy_tokens_match_generate(tiny_loaded):
    hf = AutoModelForCausalLM.from_pretrained(tiny_loaded.path, dtype=torch.float32).eval()
    engine = make_engine(tiny_loaded, kv_cache_dtype="float32", max_prefill_tokens=7)
    prompts = _prompts(tiny_loaded.hf_config.vocab_size)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, ours in zip(prompts, outputs, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )[0, len(prompt) :].tolist()
        assert ours == ref
