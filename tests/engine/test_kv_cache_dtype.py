"""A 16-bit KV cache: pages stored in float16 or bfloat16, half the bytes a float32 page takes,
carried in a hand-off with their dtype in the layout, and refused by an engine of another."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.errors import ConfigError, KVImportError
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.block_checks import num_used
from tests.support.kv_import import import_kv

PROMPT = list(range(20, 45))
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _prefill(engine: LLMEngine, request_id: str) -> int:
    engine.add_request(engine.request(request_id, PROMPT, GREEDY, prefill_only=True))
    first = -1
    while engine.requests[request_id].status != RequestStatus.HELD:
        for event in engine.step():
            first = event.token_id
    return first


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_holds_the_rounded_keys_and_values(tiny_loaded, kv_cache_dtype):
    wide = make_engine(tiny_loaded, kv_cache_dtype="float32")
    narrow = make_engine(tiny_loaded, kv_cache_dtype=kv_cache_dtype)
    assert wide.kv_cache.data.dtype == torch.float32
    assert narrow.kv_cache.data.dtype == getattr(torch, kv_cache_dtype)
    assert narrow.layout.dtype == f"torch.{kv_cache_dtype}"
    assert narrow.kv_cache_bytes * 2 == wide.kv_cache_bytes
    # the prompt's pages: layer 0's keys and values are the float32 engine's, rounded; later
    # layers move a little, as the prompt attends to rounded keys and values there
    for engine in (wide, narrow):
        _prefill(engine, "req")
    blocks = wide.requests["req"].block_ids
    expected = wide.kv_cache.export_blocks(blocks).to(narrow.kv_cache.data.dtype)
    got = narrow.kv_cache.export_blocks(narrow.requests["req"].block_ids)
    assert torch.equal(got[0], expected[0]) and not torch.equal(got, expected)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_prompt_in_chunks_gives_the_pages_and_tokens_of_one_chunk(tiny_loaded, kv_cache_dtype):
    """Every chunk attends to the rounded keys and values of the ones before and of itself."""
    whole = make_engine(tiny_loaded, kv_cache_dtype=kv_cache_dtype, prefix_caching=False)
    chunked = make_engine(
        tiny_loaded, kv_cache_dtype=kv_cache_dtype, prefix_caching=False, max_prefill_tokens=6
    )
    assert whole.generate([PROMPT], GREEDY) == chunked.generate([PROMPT], GREEDY)
    for engine in (whole, chunked):
        _prefill(engine, "req")
    pages = [e.kv_cache.export_blocks(e.requests["req"].block_ids) for e in (whole, chunked)]
    torch.testing.assert_close(pages[0].float(), pages[1].float(), rtol=1e-2, atol=1e-4)


def test_decode_on_a_float16_cache_keeps_the_float32_tokens(tiny_loaded):
    """Rounding keys and values to float16 moves logits by far less than the tiny model's
    margins between its top tokens: greedy decoding picks the same tokens."""
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 17, 30)]
    wide = make_engine(tiny_loaded, kv_cache_dtype="float32").generate(prompts, GREEDY)
    narrow = make_engine(tiny_loaded, kv_cache_dtype="float16").generate(prompts, GREEDY)
    assert narrow == wide


def test_a_float16_handoff_equals_one_engine_and_moves_half_the_bytes(tiny_loaded):
    expected = make_engine(tiny_loaded, kv_cache_dtype="float16").generate([PROMPT], GREEDY)[0]
    prefill = make_engine(tiny_loaded, kv_cache_dtype="float16")
    decode = make_engine(tiny_loaded, kv_cache_dtype="float16", num_blocks=32)
    first = _prefill(prefill, "req")
    payload = prefill.export_kv("req")
    assert payload.blocks.dtype == torch.float16 and payload.layout.dtype == "torch.float16"
    wide = make_engine(tiny_loaded, kv_cache_dtype="float32")
    _prefill(wide, "req")
    assert payload.num_bytes * 2 == wide.export_kv("req").num_bytes
    decode.importer.reserve_import(decode.request("req", PROMPT, GREEDY, disaggregated=True))
    import_kv(decode, payload, max_output_tokens=GREEDY.max_new_tokens)
    prefill.release("req")
    tokens = [first]
    while decode.has_work():
        tokens += [e.token_id for e in decode.step() if e.request_id == "req"]
    assert tokens == expected
    assert num_used(decode.blocks) == 0


@pytest.mark.parametrize("sender, receiver", [("float16", "float32"), ("auto", "float16")])
def test_pages_of_another_kv_dtype_are_refused_and_free_the_reservation(
    tiny_loaded, sender, receiver
):
    prefill = make_engine(tiny_loaded, kv_cache_dtype=sender)
    decode = make_engine(tiny_loaded, kv_cache_dtype=receiver)
    _prefill(prefill, "req")
    decode.importer.reserve_import(decode.request("req", PROMPT, GREEDY, disaggregated=True))
    with pytest.raises(KVImportError, match="dtype"):
        import_kv(decode, prefill.export_kv("req"), max_output_tokens=4)
    assert num_used(decode.blocks) == 0 and "req" not in decode.requests


def test_the_same_memory_holds_twice_the_blocks_at_16_bits(tiny_loaded):
    def blocks(kv_cache_dtype: str) -> int:
        config = EngineConfig(
            model_path=str(tiny_loaded.path),
            device="cpu",
            kv_cache_dtype=kv_cache_dtype,
            cache=CacheConfig(block_size=4, memory_mb=1),
        )
        return LLMEngine(config, tiny_loaded).blocks.num_blocks

    assert blocks("bfloat16") == 2 * blocks("float32")


def test_auto_is_the_models_dtype():
    assert EngineConfig(device="cpu").torch_kv_dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").torch_kv_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", kv_cache_dtype="float32").torch_kv_dtype == torch.float32


def test_an_unknown_kv_dtype_names_the_key_and_its_choices():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, float32"):
        EngineConfig(kv_cache_dtype="int8")
