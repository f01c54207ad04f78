"""Constrained decoding in the engine: masks equal llguidance's own, outputs match their
constraint, unconstrained rows of a mixed batch are untouched, seeds stay reproducible, a
grammar that completes finishes ``stop`` and ``length`` cuts it mid-way, and a request handed
off or continued after outputs made elsewhere ends token-identical to an undisturbed run."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from engine.constraint import MAX_SPEC_CHARS, Constraint
from engine.errors import ConfigError
from engine.grammars import GrammarCache, GrammarError, estimated_bytes, grammar_of
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.support.constraints import json_schema
from tests.support.kv_import import import_kv

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[a-z]{2,5}"
PROMPT_TEXT = "The quick brown fox"
AMBIGUOUS = "start: e\ne: e e | e e e | e e e e | /[a-z]/"  # its parse items grow every token


@pytest.fixture(autouse=True)
def generous_mask_budget(monkeypatch):
    """These tests compare outputs token by token: a mask given up on a busy machine (past its
    CPU or wall budget, ``engine/mask_pool.py``) would fail a request they expect to finish.
    The budget is raised here so that only the grammar decides; the budget's own test sets its
    own."""
    monkeypatch.setattr("engine.mask_pool.MASK_BUDGET_S", 1.0)


def _params(constraint: Constraint | None, sampled: bool = False, **options) -> SamplingParams:
    options.setdefault("max_new_tokens", 96)
    return SamplingParams(
        do_sample=sampled, temperature=1.5, seed=7, constraint=constraint, **options
    )


def _run(engine: LLMEngine, params: SamplingParams, request_id: str = "r", outputs=()):
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    engine.add_request(engine.request(request_id, prompt, params, output_token_ids=outputs))
    events = []
    while request_id in engine.requests:
        events += [e for e in engine.step() if e.request_id == request_id]
    return events


def _text(engine: LLMEngine, events) -> str:
    return engine.tokenizer.decode([e.token_id for e in events if e.token_id is not None])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_json_schema_output_validates_and_finishes_stop(tiny_engine, sampled):
    events = _run(tiny_engine, _params(json_schema(SCHEMA), sampled))
    jsonschema.validate(json.loads(_text(tiny_engine, events)), SCHEMA)
    assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.EOS)
    assert tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_regex_and_json_object_outputs_match(tiny_engine, sampled):
    events = _run(tiny_engine, _params(Constraint("regex", REGEX), sampled))
    assert re.fullmatch(REGEX, _text(tiny_engine, events))
    events = _run(tiny_engine, _params(Constraint("json_object"), sampled), "o")
    assert isinstance(json.loads(_text(tiny_engine, events)), dict)


def test_a_lark_grammar_constrains_the_output(tiny_engine):
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9]/'
    events = _run(tiny_engine, _params(Constraint("lark", grammar), True))
    assert re.fullmatch("yes|no|maybe [1-9]", _text(tiny_engine, events))
    assert events[-1].finish_reason in (FinishReason.STOP, FinishReason.EOS)


def test_max_tokens_mid_grammar_finishes_length(tiny_engine):
    events = _run(tiny_engine, _params(json_schema(SCHEMA), max_new_tokens=3))
    assert len(events) == 3 and events[-1].finish_reason == FinishReason.LENGTH
    assert _text(tiny_engine, events).startswith("{")


@pytest.mark.parametrize("few_words", [0.0, 1.0], ids=["biases", "kept-tokens"])
def test_the_mask_equals_llguidances_own(tiny_engine, monkeypatch, few_words):
    """After every token of a constrained run, the tokens the engine left finite are exactly
    those llguidance's reference matcher allows next (both ways of masking a row)."""
    monkeypatch.setattr("engine.grammar_masks.FEW_WORDS", few_words)
    constraint = json_schema(SCHEMA)
    events = _run(tiny_engine, _params(constraint, True))
    assert events[-1].error is None, events[-1].error
    tokens = [e.token_id for e in events]
    grammars: GrammarCache = tiny_engine.grammars
    reference = llguidance.LLMatcher(
        grammars.tokenizer,
        llguidance.LLMatcher.grammar_from_json_schema(
            constraint.spec,
            {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
        ),
    )
    state = grammars.state(constraint)
    vocab = tiny_engine.shape.vocab_size
    for token in tokens:
        logits = torch.zeros((2, vocab))
        grammars.mask(logits, [1], [state])
        allowed = np.flatnonzero(np.isfinite(logits[1].numpy()))
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        reference.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab]
        assert allowed.tolist() == np.flatnonzero(bits).tolist()
        assert torch.isfinite(logits[0]).all()  # an unconstrained row is untouched
        assert reference.consume_token(token) and state.matcher.consume_token(token)


def test_a_mixed_batch_leaves_unconstrained_rows_token_identical(tiny_loaded):
    free = [_params(None, sampled, max_new_tokens=24, ignore_eos=True) for sampled in (False, True)]
    alone = make_engine(tiny_loaded).generate([[5, 6, 7, 8]] * 2, free)
    constrained = [
        _params(json_schema(SCHEMA)),
        _params(Constraint("regex", REGEX), True),
    ]
    mixed = make_engine(tiny_loaded).generate([[5, 6, 7, 8]] * 4, [*free, *constrained])
    assert mixed[:2] == alone


def test_seeded_constrained_sampling_is_reproducible(tiny_loaded):
    params = _params(json_schema(SCHEMA), True)
    first = [e.token_id for e in _run(make_engine(tiny_loaded), params)]
    second = [e.token_id for e in _run(make_engine(tiny_loaded), params)]
    assert first == second


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_continued_constrained_request_matches_an_undisturbed_run(tiny_engine, sampled, k):
    """A migration: the new engine's matcher replays the k outputs before its first token."""
    params = _params(json_schema(SCHEMA), sampled)
    full = _run(tiny_engine, params, "full")
    tokens = [e.token_id for e in full]
    rest = _run(tiny_engine, params, "rest", outputs=tokens[:k])
    assert [e.token_id for e in rest] == tokens[k:]
    assert rest[-1].finish_reason == full[-1].finish_reason


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_constrained_handoff_matches_one_engine(tiny_loaded, sampled):
    """Prefill samples the first token under the grammar; decode rebuilds the matcher from the
    spec in the pages' state, replays that token and goes on: one engine's output exactly."""
    params = _params(json_schema(SCHEMA), sampled)
    full = [e.token_id for e in _run(make_engine(tiny_loaded), params)]
    prefill, decode = make_engine(tiny_loaded), make_engine(tiny_loaded)
    prefill.add_request(
        prefill.request("h", prefill.tokenizer.encode(PROMPT_TEXT), params, prefill_only=True)
    )
    first = [e.token_id for e in prefill.step() if e.request_id == "h"]
    import_kv(decode, prefill.export_kv("h", params.max_new_tokens))
    prefill.release("h")
    rest: list[int] = []
    while "h" in decode.requests:
        rest += [e.token_id for e in decode.step() if e.request_id == "h"]
    assert [*first, *rest] == full
    for engine in (prefill, decode):
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_outputs_the_grammar_refuses_end_the_request_with_an_error(tiny_engine):
    """A token made elsewhere that the spec does not allow (a forged or mismatched first
    token) is checked, not trusted: an error finish, every block freed."""
    bad = tiny_engine.tokenizer.encode("zz")[:1]
    events = _run(tiny_engine, _params(Constraint("regex", REGEX)), outputs=bad)
    assert events[-1].finish_reason == FinishReason.ERROR and "constraint" in events[-1].error
    assert events[-1].cause == "constraint_violated"
    assert tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks


def test_a_matcher_that_fails_mid_generation_fails_the_request(tiny_engine):
    """An ambiguous grammar's parser outgrows its item limit a few tokens in: llguidance errors
    and its mask allows EOS alone. The request fails (never a normal finish on that EOS) and
    every block is freed."""
    events = _run(tiny_engine, _params(Constraint("lark", AMBIGUOUS), max_new_tokens=200))
    assert events[-1].finish_reason == FinishReason.ERROR
    assert events[-1].cause == "constraint_violated"
    assert "Too many items" in events[-1].error
    assert all(e.finish_reason is None for e in events[:-1])
    assert tiny_engine.blocks.num_free_blocks == tiny_engine.blocks.num_blocks


def test_a_mask_past_its_budget_fails_its_request_and_the_batch_goes_on(tiny_loaded, monkeypatch):
    """Under the parser's default limits an ambiguous grammar's mask grows by the token, past
    any budget; the step gives up on its row alone: it fails with constraint_violated, and the
    unconstrained request sharing its steps gets every token it would get alone."""
    monkeypatch.setattr("engine.grammars.LIMITS", llguidance.LLParserLimits())
    monkeypatch.setattr("engine.mask_pool.MASK_BUDGET_S", 0.002)
    free = _params(None, max_new_tokens=60, ignore_eos=True)
    alone = make_engine(tiny_loaded).generate([[5, 6, 7, 8]], [free])[0]
    engine = make_engine(tiny_loaded)
    engine.add_request(engine.request("free", [5, 6, 7, 8], free))
    slow = _params(Constraint("lark", AMBIGUOUS), max_new_tokens=200)
    engine.add_request(engine.request("slow", [5, 6, 7, 8], slow))
    events: dict[str, list] = {"free": [], "slow": []}
    while engine.requests:
        for event in engine.step():
            events[event.request_id].append(event)
    failed = events["slow"][-1]
    assert failed.cause == "constraint_violated" and "took over 2 ms" in failed.error
    assert all(e.finish_reason is None for e in events["slow"][:-1])
    assert [e.token_id for e in events["free"]] == alone
    assert len(events["slow"]) < len(events["free"])  # it failed while the other went on
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize(
    "constraint, reason",
    [
        (Constraint("json_schema", '{"type": "objectx"}'), "objectx"),
        (Constraint("json_schema", "[1, 2"), "not accepted"),
        (Constraint("regex", "(a"), "unclosed group"),
        (Constraint("lark", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_why(tiny_engine, constraint, reason):
    with pytest.raises(GrammarError, match=reason):
        tiny_engine.add_request(tiny_engine.request("bad", [5, 6], _params(constraint)))
    assert not tiny_engine.requests


def test_a_spec_past_the_size_bound_is_refused_before_compiling():
    with pytest.raises(ConfigError, match=str(MAX_SPEC_CHARS)):
        Constraint("regex", "a" * (MAX_SPEC_CHARS + 1))
    with pytest.raises(ConfigError, match="kind"):
        Constraint("xml")


def test_equal_specs_compile_once(tiny_engine):
    grammars = tiny_engine.grammars
    before = grammars.stats.compiles
    for _ in range(3):
        grammars.compile(json_schema(dict(SCHEMA)))
    assert grammars.stats.compiles == before + 1 and grammars.stats.hits >= 2


def test_the_cache_keeps_its_capacity(tiny_loaded):
    grammars = make_engine(tiny_loaded).grammars
    grammars.capacity = 4
    for n in range(10):
        grammars.compile(Constraint("regex", f"a{{{n + 1}}}"))
    assert len(grammars) == 4


def test_a_refused_spec_is_refused_again_without_compiling(tiny_loaded):
    grammars = make_engine(tiny_loaded).grammars
    bad = Constraint("lark", "start: undefined_rule")
    messages = []
    for _ in range(3):
        with pytest.raises(GrammarError) as refused:
            grammars.compile(Constraint("lark", bad.spec))
        messages.append(str(refused.value))
    assert grammars.stats.failed_compiles == 1 and grammars.stats.refusals == 2
    assert len(set(messages)) == 1 and "undefined_rule" in messages[0]
    assert len(grammars) == 0


def test_refused_specs_are_remembered_up_to_their_bound(tiny_loaded, monkeypatch):
    monkeypatch.setattr("engine.grammars.REFUSED_SIZE", 2)
    grammars = make_engine(tiny_loaded).grammars
    specs = [Constraint("regex", f"(a{n}") for n in range(3)]
    for constraint in [*specs, specs[0]]:
        with pytest.raises(GrammarError, match="unclosed group"):
            grammars.compile(constraint)
    assert grammars.stats.failed_compiles == 4  # the first was forgotten: compiled again


def test_the_cache_keeps_its_byte_budget_evicting_the_least_recently_used(tiny_loaded):
    grammars = make_engine(tiny_loaded).grammars
    specs = [Constraint("regex", f"a{{{n + 1}}}") for n in range(6)]
    sizes = [estimated_bytes(grammar_of(c)) for c in specs]
    grammars.capacity_bytes = sum(sizes[:3])
    for constraint in specs[:3]:
        grammars.compile(constraint)
    grammars.compile(specs[0])  # used again: the most recently used
    grammars.compile(specs[3])
    assert len(grammars) == 3 and grammars.num_bytes <= grammars.capacity_bytes
    before = grammars.stats.compiles
    grammars.compile(specs[0])
    assert grammars.stats.compiles == before  # kept
    grammars.compile(specs[1])
    assert grammars.stats.compiles == before + 1  # evicted by bytes, compiled again
    grammars.capacity_bytes = 1
    grammars.compile(specs[5])
    assert len(grammars) == 1 and grammars.num_bytes == sizes[5]  # the newest stays


def test_constraints_survive_the_wire_dict():
    params = _params(json_schema(SCHEMA), True)
    again = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert again == params and again.constraint == params.constraint
    assert SamplingParams.from_dict(_params(None).to_dict()).constraint is None
