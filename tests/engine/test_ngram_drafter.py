"""The n-gram drafter (``engine/ngram_drafter.py``): the tokens after the best earlier match of
the sequence's suffix, from the token ids alone."""

from __future__ import annotations

import random

import pytest

from engine.errors import ConfigError
from engine.ngram_drafter import NgramDrafter


def test_a_quoted_span_is_drafted_from_where_it_was_quoted():
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    tokens = [1, 2, *passage, 3, 4, 5, 13, 14]  # the output starts quoting the passage
    assert NgramDrafter(max_draft=3).draft(tokens) == [15, 16, 17]


def test_nothing_matching_min_match_tokens_drafts_nothing():
    assert NgramDrafter(min_match=2).draft([1, 2, 3, 9, 3]) == []  # only "3" recurs
    assert NgramDrafter(min_match=1).draft([1, 2, 3, 9, 3]) == [9, 3]
    assert NgramDrafter().draft([5]) == [] and NgramDrafter().draft([]) == []


def test_the_longest_match_wins_over_a_later_shorter_one():
    tokens = [7, 8, 9, 100, 0, 8, 9, 200, 0, 7, 8, 9]
    assert NgramDrafter(max_draft=1).draft(tokens) == [100]  # "7 8 9" beats the later "8 9"


def test_among_equal_matches_the_latest_wins():
    tokens = [8, 9, 100, 8, 9, 200, 8, 9]
    assert NgramDrafter(max_draft=1).draft(tokens) == [200]


def test_matches_past_max_match_tokens_count_as_equal():
    tokens = [1, 2, 3, 4, 100, 9, 2, 3, 4, 200, 1, 2, 3, 4]  # 4 vs 3 tokens: max_match=3 ties
    assert NgramDrafter(max_match=3, max_draft=1).draft(tokens) == [200]
    assert NgramDrafter(max_match=4, max_draft=1).draft(tokens) == [100]


def test_the_draft_stops_at_the_limit_and_at_the_end_of_the_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter = NgramDrafter(max_draft=8)
    assert drafter.draft(tokens) == [3, 4, 5, 6, 1, 2]  # up to the end, no further
    assert drafter.draft(tokens, limit=2) == [3, 4]  # e.g. the tokens the request has left
    assert drafter.draft(tokens, limit=0) == []


def test_a_repeating_suffix_drafts_its_period():
    assert NgramDrafter(max_draft=4).draft([5, 1, 2, 1, 2, 1, 2]) == [1, 2]


def test_it_agrees_with_a_plain_search_on_random_sequences():
    rng = random.Random(7)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        drafter = NgramDrafter(min_match=rng.randint(1, 3), max_match=4, max_draft=3)
        assert drafter.draft(tokens) == _plain(drafter, tokens), tokens


def _plain(drafter: NgramDrafter, tokens: list[int]) -> list[int]:
    best, best_end = 0, -1
    for end in range(len(tokens) - 1):
        length = 0
        while (
            length < drafter.max_match
            and end - length >= 0
            and tokens[end - length] == tokens[len(tokens) - 1 - length]
        ):
            length += 1
        if length >= best and length >= 1:
            best, best_end = length, end
    if best < drafter.min_match or len(tokens) <= drafter.min_match:
        return []
    return tokens[best_end + 1 : best_end + 1 + drafter.max_draft]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"min_match": 0}, "min_match"),
        ({"min_match": 5}, "min_match"),
        ({"max_draft": 0}, "max_draft"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(settings, named):
    with pytest.raises(ConfigError, match=named):
        NgramDrafter(**settings)
