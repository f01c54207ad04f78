"""KV export/import in one process: prefill in engine A, decode in engine B."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.errors import KVImportError
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 45)), [3]]
PARAMS = [
    SamplingParams(max_new_tokens=16, ignore_eos=True),
    SamplingParams(
        max_new_tokens=16, do_sample=True, temperature=1.3, top_p=0.9, seed=42, ignore_eos=True
    ),
    SamplingParams(max_new_tokens=16, do_sample=True, top_k=20, seed=7, ignore_eos=True),
]


def _prefill(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params, prefill_only=True)
    first = None
    while engine.requests[request_id].status != RequestStatus.HELD:
        for event in engine.step():
            first = event.token_id
    return first


def _decode(engine, request_id):
    tokens = []
    while engine.has_work():
        tokens += [e.token_id for e in engine.step() if e.request_id == request_id]
    return tokens


@pytest.mark.parametrize("case", range(len(PROMPTS)))
def test_prefill_in_a_decode_in_b_equals_one_engine(tiny_loaded, case):
    prompt, params = PROMPTS[case], PARAMS[case]
    expected = make_engine(tiny_loaded).generate([prompt], params)[0]
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=32)
    first = _prefill(prefill, "req", prompt, params)
    payload = prefill.export_kv("req")
    assert payload.state.num_computed_tokens == len(prompt)
    assert payload.num_bytes > 0 and payload.blocks.is_contiguous()
    assert decode.reserve_import("req", len(prompt)) is not None
    decode.import_kv(payload, max_output_tokens=params.max_new_tokens)
    prefill.release("req")
    assert prefill.blocks.num_used_blocks == 0
    assert [first, *_decode(decode, "req")] == expected
    assert decode.blocks.num_used_blocks == 0


def test_imported_blocks_are_bit_exact(tiny_loaded):
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, "req", PROMPTS[1], PARAMS[0])
    payload = prefill.export_kv("req")
    decode.import_kv(payload, max_output_tokens=4)
    installed = decode.kv_cache.export_blocks(
        decode.requests["req"].block_ids[: payload.blocks.shape[2]]
    )
    assert torch.equal(installed, payload.blocks)


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 8),
        ("dtype", "torch.bfloat16"),
        ("model_fingerprint", "other-model"),
        ("num_layers", 3),
    ],
)
def test_handshake_mismatch_is_refused_and_frees_the_reservation(tiny_loaded, field, value):
    prefill = make_engine(tiny_loaded, block_size=4)
    decode = make_engine(tiny_loaded, block_size=4)
    _prefill(prefill, "req", PROMPTS[0], PARAMS[0])
    payload = prefill.export_kv("req")
    payload.layout = dataclasses.replace(payload.layout, **{field: value})
    decode.reserve_import("req", len(PROMPTS[0]))
    with pytest.raises(KVImportError, match=field):
        decode.import_kv(payload, max_output_tokens=4)
    assert decode.blocks.num_used_blocks == 0 and "req" not in decode.requests


def test_reserve_refuses_when_the_cache_is_full(tiny_loaded):
    decode = make_engine(tiny_loaded, block_size=4, num_blocks=3)
    assert decode.reserve_import("a", 8) is not None  # 3 blocks with room for the next token
    assert decode.reserve_import("b", 1) is None
    decode.abort("a")
    assert decode.blocks.num_used_blocks == 0
