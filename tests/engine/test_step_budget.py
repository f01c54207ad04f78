"""The step budget: prompt tokens per step sized to a target step time, learnt from the steps."""

from __future__ import annotations

import pytest

from engine.step_budget import MIN_CHUNK_TOKENS, MIN_PROMPT_STEP_TOKENS, PRIOR_DECODE_S, StepBudget


def _learn(budget: StepBudget, decode_s: float, token_s: float, steps: int = 60) -> None:
    """Steps of a machine where a decode step takes ``decode_s`` and a prompt token ``token_s``."""
    for i in range(steps):
        budget.observe(4, 0, decode_s)
        prompt = 100 + 10 * (i % 5)
        budget.observe(4, prompt, decode_s + prompt * token_s)


def test_without_a_target_a_step_takes_the_whole_budget():
    assert StepBudget(0, 8192).tokens(num_decodes=10) == 8192
    assert StepBudget(150, 8192).tokens(num_decodes=0) == 8192  # no prompt-step target
    assert StepBudget(0, 8192, prompt_target_ms=0).tokens(num_decodes=0) == 8192


def test_a_prompt_only_step_fits_its_own_target_within_its_floor_and_the_budget():
    budget = StepBudget(0, 8192, prompt_target_ms=4000)
    for _ in range(60):
        budget.observe(0, 500, 2.5)  # 5 ms a prompt token: 800 tokens fit in 4 s
    assert budget.tokens(num_decodes=0) == pytest.approx(800, abs=2)
    assert budget.tokens(num_decodes=3) == 8192  # a step that decodes: stepTargetMs's (none)
    for _ in range(60):
        budget.observe(0, 500, 10.0)  # a slower machine: 200 fit, fewer than the floor
    assert budget.tokens(num_decodes=0) == MIN_PROMPT_STEP_TOKENS
    for _ in range(60):
        budget.observe(0, 500, 0.005)  # a GPU: the whole budget fits
    assert budget.tokens(num_decodes=0) == 8192
    assert StepBudget(0, 64, prompt_target_ms=2000).tokens(0) == 64  # never over the budget


def test_the_chunk_fits_the_target_once_the_costs_are_learnt():
    budget = StepBudget(150, 8192)
    _learn(budget, decode_s=0.030, token_s=0.002)
    assert budget.decode_s == pytest.approx(0.030, rel=0.01)
    assert budget.token_s == pytest.approx(0.002, rel=0.01)
    assert budget.tokens(4) == pytest.approx(60, abs=1)  # (150 - 30) ms / 2 ms
    _learn(budget, decode_s=0.030, token_s=0.001)  # a faster machine (or fewer busy threads)
    assert budget.tokens(4) == pytest.approx(120, abs=2)


def test_a_prompt_always_progresses_and_never_exceeds_max_prefill_tokens():
    slow = StepBudget(50, 8192)
    _learn(slow, decode_s=0.080, token_s=0.002)  # decoding alone misses the target
    assert slow.tokens(4) == MIN_CHUNK_TOKENS
    fast = StepBudget(10_000, 512)
    _learn(fast, decode_s=0.010, token_s=0.0001)
    assert fast.tokens(4) == 512


def test_prompt_only_steps_teach_the_token_cost_too():
    budget = StepBudget(100, 8192)
    for _ in range(60):
        budget.observe(0, 500, 1.0)  # 2 ms a token, no decode rows
    assert budget.token_s == pytest.approx(0.002, rel=0.01)


def test_an_engine_with_a_target_chunks_prompts_beside_decodes_and_answers_the_same(tiny_loaded):
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(10, 130))]  # a stream, then a 120-token prompt beside it
    expected = make_engine(tiny_loaded, prefix_caching=False).generate(prompts, params)
    engine = make_engine(tiny_loaded, prefix_caching=False, step_target_ms=1)
    chunks: list[tuple[int, int]] = []  # (prompt tokens, decode rows) of each step
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        chunks.append((sum(n for _, n in out.prefills), len(out.decodes)))
        return out

    engine.scheduler.schedule = recording
    engine.add_request(engine.request("stream", prompts[0], params))
    engine.step()  # the stream decodes from now on
    outputs = {"stream": [], "long": []}
    engine.add_request(engine.request("long", prompts[1], params))
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                outputs[event.request_id].append(event.token_id)
    beside_decodes = [tokens for tokens, decodes in chunks[1:] if decodes and tokens]
    assert beside_decodes and max(beside_decodes) == MIN_CHUNK_TOKENS  # a 1 ms target: the least
    assert outputs["long"] == expected[1]
    assert engine.scheduler.step_budget.token_s != pytest.approx(0.003)  # learnt from its steps


def test_a_burst_on_an_idle_engine_has_its_first_tokens_step_by_step_in_order(tiny_loaded):
    """A 1 ms prompt-step target: steps of the floor's 512 tokens, first come first served; the
    answers are those of the burst computed as one step."""
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [list(range(10 + i, 130 + i)) for i in range(10)]  # 1,200 prompt tokens
    one_step = make_engine(
        tiny_loaded, num_blocks=512, prefix_caching=False, prompt_step_target_ms=0
    )
    expected = one_step.generate(prompts, params)
    engine = make_engine(tiny_loaded, num_blocks=512, prefix_caching=False, prompt_step_target_ms=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.request(f"r{i}", prompt, params))
    firsts: list[list[int]] = []  # the requests that had their first token, step by step
    tokens: dict[int, list[int]] = {i: [] for i in range(10)}
    while engine.has_work():
        events = [e for e in engine.step() if e.token_id is not None]
        firsts.append([int(e.request_id[1:]) for e in events])
        for event in events:
            tokens[int(event.request_id[1:])].append(event.token_id)
    assert firsts == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # 512 prompt tokens a step, 176 last
    assert [tokens[i] for i in range(10)] == expected


def test_a_prompt_chunked_with_one_token_left_does_not_lift_the_bound(tiny_loaded):
    """Prompts of 171 tokens in steps of 512: the first step leaves the third prompt one token
    short. That row is the prompt's, not a decode: the next step still carries 512 prompt
    tokens (it carried the whole queue, up to maxPrefillTokens, when counted as a decode)."""
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine = make_engine(tiny_loaded, num_blocks=512, prefix_caching=False, prompt_step_target_ms=1)
    for i in range(9):
        engine.add_request(engine.request(f"r{i}", list(range(10 + i, 181 + i)), params))
    firsts: list[list[int]] = []
    while engine.has_work():
        firsts.append([int(e.request_id[1:]) for e in engine.step() if e.token_id is not None])
    assert firsts == [[0, 1], [2, 3, 4], [5, 6, 7], [8]]


def test_a_prompts_last_token_teaches_the_prompt_cost_not_the_decode_cost(tiny_loaded):
    """The third prompt's last token, left by the first step, is computed as a one-token row:
    the budget learns from that step as from a prompt-only step of one token, not a decode."""
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine = make_engine(tiny_loaded, num_blocks=512, prefix_caching=False, prompt_step_target_ms=1)
    for i in range(3):
        engine.add_request(engine.request(f"r{i}", list(range(10 + i, 181 + i)), params))
    seen: list[tuple[int, int]] = []
    observe = engine.scheduler.step_budget.observe
    engine.scheduler.step_budget.observe = lambda d, p, s: (seen.append((d, p)), observe(d, p, s))
    while engine.has_work():
        engine.step()
    assert seen == [(0, 512), (0, 1)]
    assert engine.scheduler.step_budget.decode_s == pytest.approx(PRIOR_DECODE_S)
