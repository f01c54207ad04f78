"""Incremental detokenization and stop strings."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from tests.support.block_checks import num_used


def _stream(tokenizer, prompt_ids, output_ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    ids = list(prompt_ids)
    pieces, stopped = [], False
    for i, token in enumerate(output_ids):
        ids.append(token)
        stopped = detok.append(ids)
        pieces.append(detok.take_piece(stopped or i == len(output_ids) - 1))
        if stopped:
            break
    return pieces, stopped


def test_chinese_streams_without_broken_characters(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    text = "你好，世界。今天天气很好 🚀 émigré"
    ids = tokenizer.encode(text)
    pieces, _ = _stream(tokenizer, tokenizer.encode("prompt"), ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # a character spread over byte tokens was held back


def test_stop_string_is_cut_and_never_streamed(tiny_loaded):
    tokenizer = tiny_loaded.tokenizer
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    pieces, stopped = _stream(tokenizer, [5], ids, stop=("fox jumps",))
    assert stopped
    assert "".join(pieces) == "The quick brown "


def test_engine_reports_stop_finish_reason(tiny_engine):
    prompt = [5, 6, 7]
    free = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    text = tiny_engine.tokenizer.decode(free, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    tiny_engine.add_request(
        tiny_engine.request(
            "s", prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=(stop,))
        )
    )
    events = []
    while tiny_engine.has_work():
        events += tiny_engine.step()
    assert events[-1].finish_reason == FinishReason.STOP
    streamed = "".join(e.text for e in events)
    assert streamed == text[: text.index(stop)]
    assert num_used(tiny_engine.blocks) == 0
