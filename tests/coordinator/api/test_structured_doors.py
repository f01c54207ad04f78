"""Structured-output fields at the doors, in process (a recording service, the tiny model's
real tokenizer, no Ray): each door reads its fields into the request's constraint, and every
malformed, oversized or uncompilable spec is refused in the door's shape naming the field,
within a bounded time, with nothing generated."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from coordinator.api.app import create_predict_app
from coordinator.door_limits import DoorLimits
from coordinator.model_info import ModelInfo
from coordinator.served_model import ServedModels
from engine.constraint import MAX_SPEC_CHARS, Constraint
from tests.support.door_fakes import AZURE_CHAT, post
from tests.support.recording_service import TOKENIZER, RecordingService, app_for

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "digit", "schema": SCHEMA}}


class ConstraintRecorder(RecordingService):
    """Records the constraint of every request it is asked to generate."""

    def __init__(self) -> None:
        super().__init__()
        self.constraints: list[Constraint | None] = []

    async def generate(self, request: Any):
        self.constraints.append(request.params.constraint)
        async for event in super().generate(request):
            yield event


def _send(path: str, body: dict) -> tuple[Any, ConstraintRecorder]:
    service = ConstraintRecorder()
    return post(app_for(service), path, body), service


@pytest.mark.parametrize("path", ["/v1/chat/completions", AZURE_CHAT])
def test_response_format_becomes_the_constraint_on_each_chat_door(path):
    response, service = _send(path, {"messages": MESSAGES, "response_format": JSON_SCHEMA_FORMAT})
    assert response.status_code == 200, response.text
    (constraint,) = service.constraints
    assert constraint.kind == "json_schema"
    assert json.loads(constraint.spec)["properties"] == SCHEMA["properties"]
    assert json.loads(constraint.spec)["x-guidance"] == {"lenient": True}  # not strict
    strict = {
        **JSON_SCHEMA_FORMAT,
        "json_schema": {**JSON_SCHEMA_FORMAT["json_schema"], "strict": True},
    }
    response, service = _send(path, {"messages": MESSAGES, "response_format": strict})
    assert "x-guidance" not in json.loads(service.constraints[0].spec)
    for plain in ({"type": "text"}, None):
        response, service = _send(path, {"messages": MESSAGES, "response_format": plain})
        assert response.status_code == 200 and service.constraints == [None]
    response, service = _send(
        path, {"messages": MESSAGES, "response_format": {"type": "json_object"}}
    )
    assert service.constraints == [Constraint("json_object")]


@pytest.mark.parametrize(
    "field, value, kind",
    [
        ("guided_regex", "[0-9]{3}", "regex"),
        ("guided_choice", ["yes", "no"], "regex"),
        ("guided_json", SCHEMA, "json_schema"),
        ("guided_grammar", 'start: "a" | "b"', "lark"),
        ("structured_outputs", {"regex": "[a-z]+"}, "regex"),
        ("structured_outputs", {"json": json.dumps(SCHEMA)}, "json_schema"),
    ],
)
@pytest.mark.parametrize("kind_of_route", ["text", "chat"])
def test_vllm_style_fields_on_both_openai_routes(field, value, kind, kind_of_route):
    body = {field: value, "max_tokens": 4}
    if kind_of_route == "chat":
        response, service = _send("/v1/chat/completions", {**body, "messages": MESSAGES})
    else:
        response, service = _send("/v1/completions", {**body, "prompt": "hi"})
    assert response.status_code == 200, response.text
    assert service.constraints[0].kind == kind


def test_guided_choice_is_an_escaped_alternation():
    _, service = _send("/v1/completions", {"prompt": "hi", "guided_choice": ["a.b", "c|d"]})
    assert service.constraints[0].spec == r"a\.b|c\|d"


def test_tgi_grammar_becomes_the_constraint():
    for grammar, kind in (
        ({"type": "json", "value": SCHEMA}, "json_schema"),
        ({"type": "regex", "value": "[ab]+"}, "regex"),
    ):
        response, service = _send("/generate", {"inputs": "hi", "parameters": {"grammar": grammar}})
        assert response.status_code == 200, response.text
        assert service.constraints[0].kind == kind


HUGE_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "x" * 64} for i in range(1200)},
}
DEEP_SCHEMA: dict = {"type": "integer"}
for _ in range(200):  # past the grammar library's recursion limit
    DEEP_SCHEMA = {"type": "array", "items": DEEP_SCHEMA}
BAD_FORMATS = [
    ("xml", {"type": "xml"}, "response_format.type"),
    ("not-an-object", "json", "response_format"),
    (
        "no-name",
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        "response_format.json_schema.name",
    ),
    (
        "bad-name",
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
        "response_format.json_schema.name",
    ),
    (
        "strict-not-bool",
        {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes", "schema": SCHEMA}},
        "response_format.json_schema.strict",
    ),
    (
        "bad-type",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "objectx"}}},
        "response_format.json_schema.schema",
    ),
    (
        "schema-a-list",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}},
        "response_format.json_schema.schema",
    ),
    (
        "huge",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": HUGE_SCHEMA}},
        "response_format.json_schema.schema",
    ),
    (
        "deep",
        {"type": "json_schema", "json_schema": {"name": "n", "schema": DEEP_SCHEMA}},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize("name, value, param", BAD_FORMATS, ids=[b[0] for b in BAD_FORMATS])
def test_a_bad_response_format_is_400_naming_it_on_openai(name, value, param):
    started = time.monotonic()
    response, service = _send(
        "/v1/chat/completions", {"messages": MESSAGES, "response_format": value}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(
        param.split(".")[0]
    )
    assert error["param"] == param
    assert time.monotonic() - started < 5 and service.constraints == []


@pytest.mark.parametrize("name, value, param", BAD_FORMATS, ids=[b[0] for b in BAD_FORMATS])
def test_a_bad_response_format_on_azure_is_400_or_its_422(name, value, param):
    response, service = _send(AZURE_CHAT, {"messages": MESSAGES, "response_format": value})
    if name == "xml":  # a type this server does not know
        assert response.status_code == 422, response.text
        assert response.json()["code"] == "parameter_not_supported"
        assert response.json()["detail"]["loc"] == ["body", "response_format"]
    else:
        assert response.status_code == 400, response.text
        body = response.json()
        assert body["detail"]["loc"][:2] == ["body", "response_format"]
        assert body["error"]["code"] == "invalid_parameter" and body["error"]["message"]
    assert service.constraints == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_regex": "a" * (MAX_SPEC_CHARS + 1)}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"] * 300}, "guided_choice"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_bad_vllm_style_fields_are_400_naming_them(body, param):
    started = time.monotonic()
    response, service = _send("/v1/completions", {"prompt": "hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert time.monotonic() - started < 5 and service.constraints == []


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": {"type": "objectx"}},
        {"type": "regex", "value": "(a"},
        {"type": "ebnf", "value": "x"},
        "json",
    ],
)
def test_a_bad_tgi_grammar_is_422(grammar):
    response, service = _send("/generate", {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and "grammar" in response.json()["error"]
    assert service.constraints == []


def test_the_door_compiles_a_spec_once():
    model = ModelInfo("tiny", TOKENIZER, 1024, len(TOKENIZER), 1000)
    app = create_predict_app(
        ConstraintRecorder(),
        ServedModels(model, None),
        None,
        body_limit_mb=1,
        api_keys=(),
        is_ready=lambda: True,
    )
    body = {"prompt": "hi", "guided_regex": "[0-9]{4}-once"}
    for _ in range(3):
        assert post(app, "/v1/completions", body).status_code == 200
    assert model.grammars is not None
    assert model.grammars.stats.compiles == 1 and model.grammars.stats.hits == 2


def test_a_regex_that_explodes_elsewhere_compiles_in_bounded_time():
    """Nested stars and large counted repeats: no backtracking here, the lexer's fuel bounds
    the work (accepted or refused, the answer comes fast)."""
    started = time.monotonic()
    body = {"prompt": "hi", "guided_regex": "(((((a*)*)*)*)*)*b{1000}{1000}"}
    response, _ = _send("/v1/completions", body)
    assert response.status_code in (200, 400), response.text
    assert time.monotonic() - started < 5


def _schema_of(field: str) -> dict:
    return {"type": "object", "properties": {field: {"type": "integer"}}, "required": [field]}


COMPILING_DOORS = {
    "openai chat": ("/v1/chat/completions", lambda s: {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": s}}}),
    "openai completions": ("/v1/completions", lambda s: {
        "prompt": "hi", "structured_outputs": {"json": s}}),
    "azure": (AZURE_CHAT, lambda s: {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": s}}}),
    "tgi": ("/generate", lambda s: {
        "inputs": "hi", "parameters": {"grammar": {"type": "json", "value": s}}}),
}  # fmt: skip


@pytest.mark.parametrize("door", list(COMPILING_DOORS))
def test_a_client_past_its_compiles_a_minute_is_429_and_a_spec_compiled_before_is_free(door):
    path, body_of = COMPILING_DOORS[door]
    limits = DoorLimits(grammar_compiles_per_minute_per_key=1)
    service = ConstraintRecorder()
    app = app_for(service, door_limits=limits, api_keys=("key-a", "key-b"))
    key_a, key_b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    first, second = _schema_of("first"), _schema_of("second")
    assert post(app, path, body_of(first), headers=key_a).status_code == 200
    refused = post(app, path, body_of(second), headers=key_a)
    assert refused.status_code == 429, refused.text
    assert 55 <= int(refused.headers["retry-after"]) <= 60
    assert "may compile at most 1 new structured-output specs a minute" in refused.text
    assert len(service.constraints) == 1  # nothing generated for the refused one
    assert service.refusals == 1  # counted as the door gate's refusals are
    assert post(app, path, body_of(first), headers=key_a).status_code == 200  # known: free
    assert post(app, path, body_of(second), headers=key_b).status_code == 200  # its own bucket
    assert post(app, path, body_of(second), headers=key_a).status_code == 200  # now known


class OpenCounter(ConstraintRecorder):
    """Records the client's constrained requests open while each request generates."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[dict[str, int]] = []
        self.app: Any = None

    async def generate(self, request: Any):
        self.open.append(dict(self.app.state.client_limits.constrained))
        async for event in super().generate(request):
            yield event


@pytest.mark.parametrize("door", list(COMPILING_DOORS))
def test_a_constrained_generation_counts_as_open_while_it_runs_and_no_longer(door):
    path, body_of = COMPILING_DOORS[door]
    service = OpenCounter()
    limits = DoorLimits(max_constrained_requests_per_key=1)
    service.app = app = app_for(service, door_limits=limits, api_keys=("key-a",))
    headers = {"Authorization": "Bearer key-a"}
    for _ in range(2):
        assert post(app, path, body_of(_schema_of("a")), headers=headers).status_code == 200
    assert [list(held.values()) for held in service.open] == [[1], [1]]
    assert app.state.client_limits.constrained == {}
