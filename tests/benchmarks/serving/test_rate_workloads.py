"""Every rate of a serving draw serves the same request shapes in the same order, with text of
its own, and the JSON says what load each rate offered."""

from __future__ import annotations

import pytest

from benchmarks.serving.compare_modes import draw_workload
from benchmarks.serving.rate_sweep import make_encoder
from benchmarks.serving.workload import (
    KINDS,
    offered_load,
    parse_mix,
    rate_workloads,
    shapes_of,
)

MIX = parse_mix("chat=0.6,summarise=0.2,generate=0.2")


def words(text: str) -> list[int]:
    return [len(word) for word in text.split(" ")]


@pytest.mark.parametrize("encode", [None, words], ids=["no tokenizer", "a token a word"])
def test_two_rates_of_one_draw_have_the_same_shapes_and_different_text(encode):
    first, second = rate_workloads(40, MIX, encode, seed=7, rates=2)
    assert shapes_of(first) == shapes_of(second)
    assert [item.kind for item in first] == [item.kind for item in second]
    assert all(a.prompt != b.prompt for a, b in zip(first, second, strict=True))
    assert {item.kind for item in first} == set(MIX)  # 40 draws of the mix: every kind
    for item in first:
        assert (item.prompt_tokens, item.output_tokens) == KINDS[item.kind]
    # the same draw again is the same; another draw is another
    again = rate_workloads(40, MIX, encode, seed=7, rates=1)[0]
    assert [i.prompt for i in again] == [i.prompt for i in first]
    other = rate_workloads(40, MIX, encode, seed=8, rates=1)[0]
    assert shapes_of(other) != shapes_of(first)


def test_a_real_tokenizer_sizes_every_rates_prompts_alike(tiny_model_dir):
    encode = make_encoder(str(tiny_model_dir))
    by_rate = rate_workloads(6, MIX, encode, seed=3, rates=3)
    assert shapes_of(by_rate[0]) == shapes_of(by_rate[1]) == shapes_of(by_rate[2])
    for item in by_rate[2]:
        assert len(encode(item.prompt)) == item.prompt_tokens == KINDS[item.kind][0]
    assert len({items[0].prompt for items in by_rate}) == 3


def test_each_rates_offered_load_is_the_shapes_sums_times_the_rate_over_their_count():
    by_rate = rate_workloads(10, MIX, None, seed=1, rates=3)
    prompt = sum(i.prompt_tokens for i in by_rate[0])
    output = sum(i.output_tokens for i in by_rate[0])
    workload = draw_workload(1, ["0.5", "2", "inf"], by_rate)
    assert workload["same_shapes_every_rate"] and len(workload["shapes"]) == 10
    load = workload["offered_load"]
    assert load["0.5"] == {
        "prompt_tokens_per_s": round(prompt * 0.5 / 10, 2),
        "output_tokens_per_s": round(output * 0.5 / 10, 2),
    }
    assert load["2"]["prompt_tokens_per_s"] == pytest.approx(4 * load["0.5"]["prompt_tokens_per_s"])
    assert load["inf"] == offered_load(by_rate[2], None)
    assert load["inf"]["prompt_tokens_per_s"] is None
