"""The /invocations protocol at unit level: envelopes to rows, settings precedence, sampling
validation, and the completions scorer over a fake service (the real server is tested in
test_mlflow_e2e)."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.api.errors import MlflowError
from coordinator.api.mlflow import MlflowScorer
from coordinator.api.mlflow_inputs import (
    embedding_texts,
    generation_params,
    merged_settings,
    parse_scoring,
)
from coordinator.model_info import ModelInfo
from engine.outputs import TokenEvent
from engine.request import FinishReason

CHAT = "llm/v1/chat"
COMPLETIONS = "llm/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_unified_body_is_one_bare_row_with_its_settings():
    scoring = parse_scoring({"messages": MESSAGES, "max_tokens": 3, "stop": None}, CHAT)
    assert scoring.bare and scoring.inputs == [MESSAGES]
    assert scoring.settings == {"max_tokens": 3}


@pytest.mark.parametrize(
    "body",
    [
        {"dataframe_split": {"columns": ["prompt", "max_tokens"], "data": [["a", 2], ["b", 9]]}},
        {"dataframe_records": [{"prompt": "a", "max_tokens": 2}, {"prompt": "b"}]},
        {"instances": [{"prompt": "a", "max_tokens": 2}, {"prompt": "b", "max_tokens": 9}]},
        {"inputs": {"prompt": ["a", "b"], "max_tokens": [2, 9]}},
        {"inputs": {"prompt": ["a", "b"], "max_tokens": 2}},
    ],
)
def test_every_envelope_gives_rows_and_first_row_settings(body):
    scoring = parse_scoring(body, COMPLETIONS)
    assert not scoring.bare
    assert scoring.inputs == ["a", "b"]
    assert scoring.settings == {"max_tokens": 2}


def test_columnar_messages_are_one_conversation_or_a_column_of_them():
    assert parse_scoring({"inputs": {"messages": MESSAGES}}, CHAT).inputs == [MESSAGES]
    assert parse_scoring({"inputs": {"messages": [MESSAGES, MESSAGES]}}, CHAT).inputs == [
        MESSAGES,
        MESSAGES,
    ]


def test_params_are_overridden_by_row_fields():
    body = {"dataframe_records": [{"prompt": "a", "temperature": 0.2}], "params": {"top_k": 4}}
    body["params"]["temperature"] = 0.9
    assert parse_scoring(body, COMPLETIONS).settings == {"temperature": 0.2, "top_k": 4}


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({}, "exactly one of the input fields"),
        ({"inputs": {}, "instances": []}, "exactly one of the input fields"),
        ({"inputs": {"messages": MESSAGES}, "params": [1]}, "'params' must be a JSON object"),
        ({"dataframe_split": {"columns": ["prompt"], "data": [["a", 1]]}}, "must have 1 values"),
        ({"dataframe_records": []}, "no rows"),
        ({"dataframe_records": [{"messages": MESSAGES}]}, "takes 'prompt' as input"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_malformed_bodies_are_bad_request(body, fragment):
    with pytest.raises(MlflowError) as info:
        parse_scoring(body, COMPLETIONS)
    assert info.value.code == "BAD_REQUEST" and info.value.status == 400
    assert fragment in info.value.message


def test_precedence_and_max_tokens_mapping():
    saved = {"max_new_tokens": 6, "temperature": 0.5}
    assert merged_settings(saved, {"max_tokens": 2}) == {"max_new_tokens": 2, "temperature": 0.5}
    params = generation_params(merged_settings(saved, {}), COMPLETIONS, 100)
    assert params.max_new_tokens == 6 and params.do_sample and params.temperature == 0.5


def test_sampling_is_greedy_unless_asked_for():
    assert not generation_params({}, CHAT, 100).do_sample
    assert generation_params({}, CHAT, 100).max_new_tokens == 512
    assert not generation_params({"temperature": 0.7, "do_sample": False}, CHAT, 100).do_sample
    assert generation_params({"do_sample": True}, CHAT, 100).do_sample
    assert generation_params({"stop": "x"}, CHAT, 100).stop == ("x",)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"max_new_tokens": 0}, "'max_tokens' (max_new_tokens) must be an integer in [1, "),
        ({"temperature": 3}, "'temperature' must be a number in [0, 2], got 3"),
        ({"top_p": "x"}, "'top_p' must be a number in [0, 1], got \"x\""),
        ({"do_sample": "yes"}, "'do_sample' must be true or false"),
        ({"n": 2}, "'n' must be 1"),
        ({"logprobs": 2}, "unsupported parameter 'logprobs'"),
    ],
)
def test_bad_settings_name_the_parameter(settings, fragment):
    with pytest.raises(MlflowError) as info:
        generation_params(settings, CHAT, 100)
    assert info.value.code == "INVALID_PARAMETER_VALUE"
    assert fragment in info.value.message


def test_unknown_saved_keys_are_skipped_not_rejected():
    params = generation_params(
        {"no_repeat_ngram_size": 3}, CHAT, 100, frozenset({"no_repeat_ngram_size"})
    )
    assert params.max_new_tokens == 512


def test_embedding_inputs_flatten():
    assert embedding_texts(["a", ["b", "c"]]) == ["a", "b", "c"]
    with pytest.raises(MlflowError):
        embedding_texts([""])


class _FakeService:
    def __init__(self) -> None:
        self.params = []
        self.in_flight, self.max_requests, self.draining = 0, 100, False  # admission

    def count_refusal(self) -> None:
        """Admission's hook for a request refused at the door (nothing counts it here)."""

    def new_request_id(self) -> str:
        return "r"

    async def generate(self, request):
        self.params.append(request.params)
        now = time.monotonic()
        request_id, num_prompt = request.request_id, request.num_prompt_tokens
        yield TokenEvent(request_id, 5, "ab", num_prompt, 1, now)
        yield TokenEvent(request_id, 6, "c", num_prompt, 2, now, FinishReason.LENGTH)


def test_completions_scorer_answers_text_completions(tiny_loaded):
    model = ModelInfo("tiny", tiny_loaded.tokenizer, 1024, 512, 1000)
    service = _FakeService()
    scorer = MlflowScorer(COMPLETIONS, {"max_new_tokens": 2}, service, model)
    answer = asyncio.run(
        scorer.predict(parse_scoring({"inputs": {"prompt": ["x", "y"]}}, COMPLETIONS))
    )
    assert [a["object"] for a in answer] == ["text_completion"] * 2
    assert answer[0]["choices"][0] == {
        "index": 0,
        "text": "abc",
        "finish_reason": "length",
        "logprobs": None,
    }
    assert answer[0]["usage"]["completion_tokens"] == 2 and answer[0]["model"] == "tiny"
    assert [p.max_new_tokens for p in service.params] == [2, 2]
