"""A request continued after output tokens it generated elsewhere (a migration) goes on exactly
as if it had never stopped: the same tokens (greedy and seeded), the same text, the same counts,
on one engine and across a prefill → decode hand-off."""

from __future__ import annotations

import pytest

from engine.llm_engine import LLMEngine
from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.kv_import import import_kv

PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.3, seed=5, ignore_eos=True)
STOPPING = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=("zzzz-never",))


def _run(engine: LLMEngine, request_id: str, params: SamplingParams, outputs=()) -> list:
    engine.add_request(engine.request(request_id, PROMPT, params, output_token_ids=outputs))
    events: list[TokenEvent] = []
    while request_id in engine.requests:
        events += [e for e in engine.step() if e.request_id == request_id]
    return events


@pytest.mark.parametrize("params", [GREEDY, SEEDED, STOPPING], ids=["greedy", "seeded", "stop"])
@pytest.mark.parametrize("k", [1, 5, 11])
def test_continued_request_matches_an_uninterrupted_run(tiny_engine, params, k):
    full = _run(tiny_engine, "full", params)
    tokens = [e.token_id for e in full]
    rest = _run(tiny_engine, "rest", params, outputs=tokens[:k])
    assert [e.token_id for e in rest] == tokens[k:]
    assert [e.num_output_tokens for e in rest] == [e.num_output_tokens for e in full[k:]]
    assert [e.num_prompt_tokens for e in rest] == [len(PROMPT)] * len(rest)
    assert "".join(e.text for e in rest) == "".join(e.text for e in full[k:])
    assert rest[-1].finish_reason == full[-1].finish_reason
    assert tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks


def test_continuing_past_the_output_limit_is_refused(tiny_engine):
    from engine.errors import RequestRejectedError

    with pytest.raises(RequestRejectedError, match="12 output tokens already generated"):
        tiny_engine.add_request(
            tiny_engine.request("r", PROMPT, GREEDY, output_token_ids=list(range(12)))
        )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_continued_request_across_a_handoff(tiny_loaded, params):
    """Prefill computes prompt + outputs so far and samples one token; decode goes on from the
    pages: the whole output equals one engine's uninterrupted run."""
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    full = [e.token_id for e in _run(make_engine(tiny_loaded), "full", params)]
    k = 4
    prefill.add_request(
        prefill.request("m", PROMPT, params, prefill_only=True, output_token_ids=full[:k])
    )
    first = [e for e in prefill.step() if e.request_id == "m"]
    assert [e.token_id for e in first] == [full[k]]
    assert first[0].num_output_tokens == k + 1
    import_kv(decode, prefill.export_kv("m", params.max_new_tokens))
    prefill.release("m")
    rest: list[int] = []
    while "m" in decode.requests:
        rest += [e.token_id for e in decode.step() if e.request_id == "m"]
    assert [*full[:k], full[k], *rest] == full
    for engine in (prefill, decode):
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_pages_with_no_token_left_to_decode_are_refused(tiny_loaded):
    """A hand-off whose outputs already reach the decode limit would make decode overshoot it."""
    from engine.errors import KVImportError

    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    prefill.add_request(
        prefill.request("m", PROMPT, GREEDY, prefill_only=True, output_token_ids=[9, 9, 9])
    )
    prefill.step()
    with pytest.raises(KVImportError, match="output limit 4 is not within 5"):
        import_kv(decode, prefill.export_kv("m", 4))
    prefill.release("m")
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks
