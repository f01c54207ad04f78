"""Speculative decoding (``engine/speculation.py``) on the tiny model: drafted tokens checked
several at a time give exactly the tokens of decoding without drafts (greedy, seeded, with
penalties, limits and stop strings, across a hand-off, with prompts joining mid-way), rejected
tokens leave no block and no KV event behind, and the drafting adapts and yields."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.constraint import Constraint
from engine.kv_events import STORED
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculation import (
    BREAK_EVEN_MARGIN,
    MISSES_TO_PAUSE,
    PRIOR_ROW_SHARE,
    PROBE_AFTER_STEPS,
    Acceptance,
    DraftState,
    Speculator,
    StepCost,
)
from tests.support.kv_import import import_kv

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(3, 30)) * 2, [11, 12, 11, 12, 13]]
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=32, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=32, do_sample=True, seed=7, temperature=0.8),
    "penalized": SamplingParams(
        max_new_tokens=24, do_sample=True, seed=3, top_k=5, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((7, 2.0),), ignore_eos=True,
    ),
}  # fmt: skip


class OracleDrafter:
    """Drafts the reference continuation of whichever reference a sequence starts, with every
    ``corrupt_every``-th draft's last token wrong: checks that accept everything, and checks
    that reject mid-draft."""

    def __init__(self, references: Sequence[list[int]], corrupt_every: int = 3) -> None:
        self.references, self.corrupt_every, self.drafts = references, corrupt_every, 0

    def draft(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        for full in self.references:
            if full[: len(token_ids)] == list(token_ids):
                draft = full[len(token_ids) : len(token_ids) + (limit or 4)]
                self.drafts += 1
                if draft and self.drafts % self.corrupt_every == 0:
                    draft[-1] = (draft[-1] + 1) % 64
                return draft
        return []


def engine_for(loaded: LoadedModel, method: str = "ngram", **speculative: int) -> LLMEngine:
    config = EngineConfig(
        model_path=str(loaded.path),
        device="cpu",
        cache=CacheConfig(block_size=4, num_blocks=256, enable_prefix_caching=True),
        batch_invariant=True,
        speculative=SpeculativeConfig(method=method, **speculative),  # type: ignore[arg-type]
    )
    return LLMEngine(config, loaded)


def with_oracle(loaded: LoadedModel, prompts, outputs, **speculative: int) -> LLMEngine:
    engine = engine_for(loaded, **speculative)
    assert engine.speculator is not None
    references = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    engine.speculator.drafter = OracleDrafter(references)  # type: ignore[assignment]
    engine.speculator.acceptance = Acceptance.prior(1.0)  # drafts whatever tiny steps cost
    return engine


def stored_hashes(engine: LLMEngine) -> list[bytes]:
    return [h for _, kind, h in engine.blocks.events.since(engine.blocks.events.epoch, 0).events
            if kind == STORED]  # fmt: skip


@pytest.mark.parametrize("name", PARAMS)
def test_drafted_tokens_are_the_tokens_without_drafts(tiny_loaded, name):
    params = PARAMS[name]
    plain = engine_for(tiny_loaded, "off")
    expected = plain.generate(PROMPTS, params)
    engine = with_oracle(tiny_loaded, PROMPTS, expected)
    assert engine.generate(PROMPTS, params) == expected
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # accepted and rejected both
    # rejected tokens left nothing behind: every block free, the same blocks hashed
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert set(stored_hashes(engine)) == set(stored_hashes(plain))


def test_ngram_drafts_on_repeating_prompts(tiny_loaded):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = engine_for(tiny_loaded, "off").generate(PROMPTS, params)
    engine = engine_for(tiny_loaded, min_match=1)
    assert engine.speculator is not None
    engine.speculator.acceptance = Acceptance.prior(1.0)  # drafts whatever tiny steps cost
    assert engine.generate(PROMPTS, params) == expected
    assert engine.speculator.stats.drafted > 0


def test_limits_and_stop_strings_count_tokens_not_steps(tiny_loaded):
    plain = engine_for(tiny_loaded, "off")
    expected = plain.generate(PROMPTS[:1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    stop = plain.tokenizer.decode(expected[9:11])
    for params in (
        SamplingParams(max_new_tokens=7, ignore_eos=True),  # ends inside a draft
        SamplingParams(max_new_tokens=30, ignore_eos=True, stop=(stop,)),
    ):
        want = plain.generate(PROMPTS[:1], params)
        engine = with_oracle(tiny_loaded, PROMPTS[:1], [expected])
        assert engine.generate(PROMPTS[:1], params) == want
    assert len(want[0]) < 30  # the stop string stopped it


def test_prompts_joining_decoding_requests(tiny_loaded):
    """Steps that mix decode rows with a new prompt's chunk give the decode rows the bits of a
    decode-only step."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        outputs: dict[str, list[int]] = {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(engine.request(f"r{i}", prompt, params))
            for _ in range(3):  # the next prompt arrives while these decode
                for event in engine.step():
                    outputs.setdefault(event.request_id, []).append(event.token_id)
        while engine.has_work():
            for event in engine.step():
                outputs.setdefault(event.request_id, []).append(event.token_id)
        return outputs

    expected = run(engine_for(tiny_loaded, "off"))
    engine = with_oracle(tiny_loaded, PROMPTS, [expected[f"r{i}"] for i in range(3)])
    assert run(engine) == expected


def test_drafting_continues_after_a_handoff(tiny_loaded, payload):
    """A decode engine that speculates continues a hand-off with the tokens of one that does
    not (the draft is rebuilt from the tokens: nothing of it crossed)."""
    outputs = {}
    for method in ("off", "ngram"):
        engine = engine_for(tiny_loaded, method, min_match=1)
        import_kv(engine, payload, max_output_tokens=24)
        request = engine.requests[payload.state.request_id]
        assert request.status == RequestStatus.RUNNING
        tokens = []
        while engine.has_work():
            tokens += [e.token_id for e in engine.step() if e.token_id is not None]
        outputs[method] = tokens
    assert outputs["ngram"] == outputs["off"] and len(outputs["off"]) > 1


@pytest.mark.parametrize("sampled", [False, True])
def test_constrained_drafts_are_cut_by_the_grammar(tiny_loaded, sampled):
    """A draft is cut where the grammar stops allowing it, and each row is masked by the
    matcher as the accepted tokens left it: the constrained tokens of decoding without drafts."""
    constraint = Constraint(
        "json_schema",
        '{"type": "object", "properties": {"a": {"type": '
        '"array", "items": {"type": "integer"}}}, "required": ["a"]}',
    )
    params = SamplingParams(
        max_new_tokens=40, do_sample=sampled, temperature=1.5, seed=7, constraint=constraint
    )  # fmt: skip
    expected = engine_for(tiny_loaded, "off").generate(PROMPTS, params)
    engine = with_oracle(tiny_loaded, PROMPTS, expected)
    engine.speculator.drafter.corrupt_every = 2  # type: ignore[union-attr]
    assert engine.generate(PROMPTS, params) == expected
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("sampled", [False, True])
def test_a_migrated_request_drafts_again_and_continues_alike(tiny_loaded, sampled):
    """A request that arrives with outputs made elsewhere (a migration, mid-draft or not: no
    draft outlives its step) continues with the tokens it would have had undisturbed."""
    params = SamplingParams(max_new_tokens=30, do_sample=sampled, seed=9, ignore_eos=True)
    whole = engine_for(tiny_loaded, "off").generate(PROMPTS[:1], params)[0]
    outputs = {}
    for method in ("off", "ngram"):
        engine = engine_for(tiny_loaded, method, min_match=1)
        engine.add_request(engine.request("m", PROMPTS[0], params, output_token_ids=whole[:11]))
        outputs[method] = [
            e.token_id for _ in range(64) for e in engine.step() if e.token_id is not None
        ]
    assert outputs["ngram"] == outputs["off"] == whole[11:]


def test_opted_out_and_crowded_requests_get_no_draft(tiny_loaded):
    engine = engine_for(tiny_loaded, min_match=1, max_step_rows=2)
    assert engine.speculator is not None
    out_of_it = SamplingParams(max_new_tokens=12, ignore_eos=True, speculative=False)
    engine.generate(PROMPTS[:1], out_of_it)
    crowded = SamplingParams(max_new_tokens=12, ignore_eos=True)  # 3 rows > max_step_rows 2
    engine.generate(PROMPTS, crowded)
    assert engine.speculator.stats.checks == 0


def test_drafts_shrink_grow_and_pause():
    speculator = Speculator(SpeculativeConfig(method="ngram", max_draft=4), max_seq_len=1024)

    class Stub:
        draft_state = DraftState(length=4, acceptance=Acceptance.prior(0.5))

    request = Stub()
    speculator.record(request, drafted=4, accepted=1)  # type: ignore[arg-type]
    assert request.draft_state.length == 2
    speculator.record(request, drafted=2, accepted=2)  # type: ignore[arg-type]
    assert request.draft_state.length == 3
    for _ in range(MISSES_TO_PAUSE):
        speculator.record(request, drafted=1, accepted=0)  # type: ignore[arg-type]
    assert request.draft_state.paused_steps > 0 and request.draft_state.length == 1
    assert speculator.stats.checks == 2 + MISSES_TO_PAUSE
    assert speculator.stats.accepted_histogram[0] == MISSES_TO_PAUSE


def test_the_step_cost_fit_and_its_break_even():
    cost = StepCost()
    assert cost.row_share() == PRIOR_ROW_SHARE  # nothing seen yet
    for _ in range(100):  # steps of one size: no slope to fit, the prior's
        cost.observe(8, 0.030)
    assert cost.row_share() == PRIOR_ROW_SHARE
    for _ in range(200):  # steps of 1 to 5 rows: 8 ms + 2 ms a row
        for rows in range(1, 6):
            cost.observe(rows, 0.008 + 0.002 * rows)
    assert cost.row_share() == pytest.approx(0.25, rel=0.05)
    assert cost.break_even(1) == pytest.approx(0.2 * BREAK_EVEN_MARGIN, rel=0.05)
    assert cost.break_even(1) < cost.break_even(8) < cost.break_even(32) < BREAK_EVEN_MARGIN


def test_drafts_stop_where_they_cannot_pay_for_their_rows(tiny_loaded):
    """A request whose drafts are mostly rejected drafts alone in a step, where a row is
    cheap, and not beside many rows, where it costs as much as a token is worth."""
    engine = engine_for(tiny_loaded, min_match=1)
    speculator = engine.speculator
    assert speculator is not None
    for _ in range(200):
        for rows in range(1, 6):
            speculator.observe_step(rows, 0.008 + 0.002 * rows)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    request = engine.new_request(engine.request("r", PROMPTS[0], params, output_token_ids=(8,)))
    request.num_computed_tokens = request.num_tokens - 1  # decoding: its output to compute
    request.draft_state = DraftState(length=4, acceptance=Acceptance.prior(0.4))
    assert speculator.draft(request, room=4, decode_rows=1)  # 0.4 > 0.2 * 1.2
    assert not speculator.draft(request, room=4, decode_rows=8)  # 0.4 < 16 / 24
    for _ in range(PROBE_AFTER_STEPS):  # it sits out, then probes once
        assert not speculator.draft(request, room=4, decode_rows=8)
    assert request.draft_state.probing
    assert speculator.draft(request, room=4, decode_rows=8)
    assert not speculator.draft(request, room=4, decode_rows=8)


def test_a_chunked_prompt_step_with_no_row_to_sample(tiny_loaded):
    """A batch-invariant step may sample nothing (a prompt chunk mid-way): the LM head then
    computes no row."""
    config = EngineConfig(
        model_path=str(tiny_loaded.path),
        device="cpu",
        batch_invariant=True,
        scheduler=SchedulerConfig(max_prefill_tokens=16),
    )
    engine = LLMEngine(config, tiny_loaded)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert len(engine.generate([list(range(3, 43))], params)[0]) == 4
