"""Speculative decoding on the bundled model (its Q4_1 blocks, the fused decode layers in one
parallel region): on prompts whose answers quote them, n-gram drafts are accepted and the tokens
are those of decoding without drafts, greedy and seeded, several requests at once."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PASSAGE = (
    "The committee met on Tuesday. It approved the budget for the new library, the repair of "
    "the north bridge and the summer reading programme for children."
)
PROMPTS = [
    f"Copy this text exactly.\nText: {PASSAGE}\nCopy: {PASSAGE[:40]}",
    f"Text: {PASSAGE}\nQuestion: what did the committee approve?\nAnswer: It approved",
]


def engine(bundled_loaded, method: str) -> LLMEngine:
    speculative = SpeculativeConfig(method=method)
    config = EngineConfig(device="cpu", batch_invariant=True, speculative=speculative)
    return LLMEngine(config, bundled_loaded)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=40, do_sample=True, seed=5, temperature=0.7, top_p=0.9),
    ],
    ids=["greedy", "seeded"],
)
def test_drafts_on_quoting_prompts_keep_the_tokens(bundled_loaded, params):
    plain = engine(bundled_loaded, "off")
    prompts = [plain.tokenizer.encode(p) for p in PROMPTS]
    expected = plain.generate(prompts, params)
    speculative = engine(bundled_loaded, "ngram")
    assert speculative.generate(prompts, params) == expected
    stats = speculative.speculator.stats  # type: ignore[union-attr]
    assert stats.accepted > 0, stats
    assert speculative.blocks.num_free_blocks == speculative.blocks.num_blocks
