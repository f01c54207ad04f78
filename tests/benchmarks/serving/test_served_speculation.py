"""The served speculation benchmark's parts that need no server: llama-server's speculation
options and the comparison of answers."""

from __future__ import annotations

import pytest

from benchmarks.serving.served_speculation import (
    LLAMA_CANDIDATES,
    Answers,
    _same_text,
    llama_spec_options,
)


def test_a_speculation_becomes_llama_servers_options():
    assert llama_spec_options("ngram-cache") == ("--spec-type", "ngram-cache")
    assert llama_spec_options("ngram-simple:size-n=3,size-m=8") == (
        "--spec-type", "ngram-simple",
        "--spec-ngram-simple-size-n", "3",
        "--spec-ngram-simple-size-m", "8",
    )  # fmt: skip
    for spec in LLAMA_CANDIDATES:
        assert llama_spec_options(spec)[:2] == ("--spec-type", spec.partition(":")[0])


@pytest.mark.parametrize("spec", ["draft-simple", "ngram-simple:size-n", "ngram-simple:=3"])
def test_anything_but_an_ngram_speculation_with_settings_is_refused(spec):
    with pytest.raises(ValueError, match="ngram|KEY=VALUE"):
        llama_spec_options(spec)


def test_same_text_is_the_share_of_answers_alike_in_every_round():
    ours = [Answers(["a", "b"]), Answers(["a", "c"])]
    theirs = [Answers(["a", "b"]), Answers(["a", "b"])]
    assert _same_text(ours, theirs) == 0.75
