"""No door silently ignores a field: every field each door's API defines, sent with a value that
asks for something, is either honoured (it reaches the request's sampling parameters, or the
answer shows it) or refused in the door's shape naming it. In process: a recording service and
the tiny model's real tokenizer, no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.api.openai_fields import HONOURED, IDENTIFIERS, OFF_VALUES
from tests.support.door_fakes import AZURE_CHAT, post
from tests.support.recording_service import RecordingService, app_for

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class ParamsRecorder(RecordingService):
    def __init__(self) -> None:
        super().__init__(("ok",))
        self.requests: list[Any] = []

    async def generate(self, request: Any):
        self.requests.append(request)
        async for event in super().generate(request):
            yield event


def _send(path: str, body: dict, **kwargs: Any) -> tuple[Any, ParamsRecorder]:
    service = ParamsRecorder()
    return post(app_for(service), path, body, **kwargs), service


# field -> (a value that asks for something, what the request's params must show; None: a
# refusal is expected)
OPENAI_ASKS: dict[str, tuple[Any, Any]] = {
    "model": ("anything", lambda p: True),
    "max_tokens": (7, lambda p: p.max_new_tokens == 7),
    "max_completion_tokens": (5, lambda p: p.max_new_tokens == 5),
    "temperature": (0.7, lambda p: p.do_sample and p.temperature == 0.7),
    "top_p": (0.5, lambda p: p.top_p == 0.5),
    "seed": (9, lambda p: p.seed == 9),
    "stop": (["zz"], lambda p: p.stop == ("zz",)),
    "n": (1, lambda p: True),
    "stream": (False, lambda p: True),
    "stream_options": ({"include_usage": True}, lambda p: True),
    "presence_penalty": (0.5, lambda p: p.presence_penalty == 0.5),
    "frequency_penalty": (-0.5, lambda p: p.frequency_penalty == -0.5),
    "logit_bias": ({"12": 5}, lambda p: p.logit_bias == ((12, 5.0),)),
    "response_format": ({"type": "json_object"}, lambda p: p.constraint is not None),
    "tools": (TOOLS, "tools"),
    "tool_choice": ("auto", "tools"),
    "parallel_tool_calls": (True, "tools"),
}


@pytest.mark.parametrize(
    "kind, path", [("chat", "/v1/chat/completions"), ("text", "/v1/completions")]
)
@pytest.mark.parametrize("field", sorted({*HONOURED, *IDENTIFIERS, *OFF_VALUES}))
def test_every_openai_field_is_honoured_or_refused_naming_it(kind, path, field):
    base = {"messages": MESSAGES} if kind == "chat" else {"prompt": "hi"}
    if field == "logprobs":  # chat's is a flag, completions' a count of alternatives
        value, check = (True, lambda p: p.logprobs == 0) if kind == "chat" else (
            2, lambda p: p.logprobs == 2)  # fmt: skip
    elif field in OPENAI_ASKS:
        value, check = OPENAI_ASKS[field]
    elif field in IDENTIFIERS:
        value, check = ({"k": "v"} if field == "metadata" else "someone"), (lambda p: True)
    else:  # a value asking for what the field does: refused unless honoured
        value, check = _asking(field), None
    if check == "tools":
        return  # the tool-call tests cover tools, tool_choice, parallel_tool_calls
    response, service = _send(path, {**base, field: value})
    if check is None:
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field
        assert field in response.json()["error"]["message"]
        assert service.requests == []
    else:
        assert response.status_code == 200, (field, response.text)
        assert check(service.requests[0].params), (field, service.requests[0].params)


def _asking(field: str) -> Any:
    return {
        "store": True,
        "service_tier": "priority",
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "prediction": {"type": "content", "content": "x"},
        "web_search_options": {},
        "reasoning_effort": "high",
        "verbosity": "low",
        "functions": [{"name": "f"}],
        "function_call": "auto",
        "best_of": 3,
        "echo": True,
        "suffix": "tail",
    }[field]


def test_a_field_openai_does_not_define_is_400_as_openai_answers_it():
    response, service = _send("/v1/chat/completions", {"messages": MESSAGES, "temprature": 0.5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "Unrecognized request argument supplied: temprature"
    assert error["param"] == "temprature" and service.requests == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream_options": {"other": True}}, "stream_options"),
        ({"user": "u" * 513}, "user"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_bad_values_of_honoured_fields_are_400_naming_them(body, param):
    response, service = _send("/v1/completions", {"prompt": "hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and service.requests == []


AZURE_ASKS: dict[str, tuple[Any, Any]] = {
    "temperature": (0.7, lambda p: p.temperature == 0.7),
    "top_p": (0.5, lambda p: p.top_p == 0.5),
    "max_tokens": (7, lambda p: p.max_new_tokens == 7),
    "stop": (["zz"], lambda p: p.stop == ("zz",)),
    "seed": (9, lambda p: p.seed == 9),
    "stream": (False, lambda p: True),
    "presence_penalty": (0.5, lambda p: p.presence_penalty == 0.5),
    "frequency_penalty": (0.5, lambda p: p.frequency_penalty == 0.5),
    "response_format": ({"type": "json_object"}, lambda p: p.constraint is not None),
    "model": ("anything", lambda p: True),
    "stream_options": ({"include_usage": True}, lambda p: True),
}


@pytest.mark.parametrize("field", sorted(AZURE_ASKS))
def test_every_azure_chat_field_is_honoured(field):
    value, check = AZURE_ASKS[field]
    response, service = _send(AZURE_CHAT, {"messages": MESSAGES, field: value})
    assert response.status_code == 200, (field, response.text)
    assert check(service.requests[0].params)


TGI_ASKS: dict[str, tuple[Any, Any]] = {
    "temperature": (0.7, lambda r, a: r.params.temperature == 0.7),
    "top_k": (5, lambda r, a: r.params.top_k == 5),
    "top_p": (0.5, lambda r, a: r.params.top_p == 0.5),
    "typical_p": (0.5, lambda r, a: r.params.typical_p == 0.5),
    "do_sample": (True, lambda r, a: r.params.do_sample),
    "max_new_tokens": (7, lambda r, a: r.params.max_new_tokens == 7),
    "seed": (9, lambda r, a: r.params.seed == 9),
    "repetition_penalty": (1.3, lambda r, a: r.params.repetition_penalty == 1.3),
    "frequency_penalty": (0.5, lambda r, a: r.params.frequency_penalty == 0.5),
    "details": (True, lambda r, a: "details" in a),
    "stop": (["zz"], lambda r, a: r.params.stop == ("zz",)),
    "grammar": ({"type": "regex", "value": "[ab]+"}, lambda r, a: r.params.constraint is not None),
    "return_full_text": (True, lambda r, a: a["generated_text"] == "hi there" + "ok"),
    "truncate": (1, lambda r, a: len(r.prompt_token_ids) == 1),
    "best_of": (3, None),
    "decoder_input_details": (True, None),
    "top_n_tokens": (2, lambda r, a: r.params.logprobs == 2 and a["details"]["top_tokens"]),
    "adapter_id": ("lora", None),
    "watermark": (True, None),
}


@pytest.mark.parametrize("field", sorted(TGI_ASKS))
def test_every_tgi_parameter_is_honoured_or_refused_naming_it(field):
    value, check = TGI_ASKS[field]
    response, service = _send("/generate", {"inputs": "hi there", "parameters": {field: value}})
    if check is None:
        assert response.status_code == 422, (field, response.text)
        assert field in response.json()["error"] and service.requests == []
    else:
        assert response.status_code == 200, (field, response.text)
        assert check(service.requests[0], response.json()), (field, response.json())


MINDIE_ASKS: dict[str, tuple[Any, Any]] = {
    "temperature": (0.7, lambda r: r.params.temperature == 0.7),
    "top_k": (5, lambda r: r.params.top_k == 5),
    "top_p": (0.5, lambda r: r.params.top_p == 0.5),
    "max_new_tokens": (7, lambda r: r.params.max_new_tokens == 7),
    "do_sample": (True, lambda r: r.params.do_sample),
    "seed": (9, lambda r: r.params.seed == 9),
    "repetition_penalty": (1.3, lambda r: r.params.repetition_penalty == 1.3),
    "details": (True, lambda r: True),
    "typical_p": (0.5, lambda r: r.params.typical_p == 0.5),
    "watermark": (True, lambda r: True),  # MindIE's own: accepted, not applied (documented)
    "priority": (1, lambda r: r.priority == 1),
    "timeout": (30, lambda r: r.timeout_s == 30),
}


@pytest.mark.parametrize("field", sorted(MINDIE_ASKS))
def test_every_mindie_parameter_is_honoured(field):
    value, check = MINDIE_ASKS[field]
    response, service = _send("/infer", {"inputs": "hi", "parameters": {field: value}})
    assert response.status_code == 200, (field, response.text)
    assert check(service.requests[0]), field


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_speculative_extension_reaches_the_request_and_is_checked(path):
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    response, service = _send(path, body)
    assert response.status_code == 200 and service.requests[0].params.speculative is True
    response, service = _send(path, {**body, "speculative": False})
    assert response.status_code == 200 and service.requests[0].params.speculative is False
    response, service = _send(path, {**body, "speculative": "no"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculative"
    assert service.requests == []
