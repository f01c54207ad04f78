"""Every row of the /infer parameter table (docs/api.md): accepted boundary values, rejected
ones just outside, wrong JSON types, null as absent; with the message naming parameter, range
and value."""

from __future__ import annotations

import pytest

from coordinator.api.errors import BadRequestError, InputValidationError
from coordinator.api.mindie_request import MAX_INPUT_CHARS, parse_infer_body

ACCEPTED = [
    ("temperature", 1e-5),
    ("temperature", 2),
    ("temperature", 100.0),
    ("top_k", 1),
    ("top_k", 2147483647),
    ("top_p", 1e-5),
    ("top_p", 0.999999),
    ("max_new_tokens", 1),
    ("max_new_tokens", 2147483647),
    ("seed", 1),
    ("seed", 18446744073709551615),
    ("repetition_penalty", 1e-9),
    ("repetition_penalty", 2),
    ("typical_p", 1e-9),
    ("typical_p", 1.0),
    ("typical_p", 1),
    ("priority", 1),
    ("priority", 5),
    ("timeout", 1),
    ("timeout", 3600),
    ("do_sample", True),
    ("details", False),
    ("watermark", True),
    ("ignore_eos", True),
    ("speculative", False),
]

REJECTED = [  # (parameter, value, the range named in the message)
    ("temperature", 0, "a float > 1e-06"),
    ("temperature", 1e-6, "a float > 1e-06"),
    ("temperature", -1, "a float > 1e-06"),
    ("temperature", "0.5", "a float > 1e-06"),
    ("top_k", 0, "an integer in (0, 2147483647]"),
    ("top_k", 2147483648, "(0, 2147483647]"),
    ("top_k", 1.5, "an integer in (0, 2147483647]"),
    ("top_k", True, "(0, 2147483647]"),
    ("top_p", 1.0, "a float in (1e-06, 1.0)"),
    ("top_p", 1, "(1e-06, 1.0)"),
    ("top_p", 1e-6, "(1e-06, 1.0)"),
    ("top_p", 0, "(1e-06, 1.0)"),
    ("max_new_tokens", 0, "(0, 2147483647]"),
    ("max_new_tokens", -5, "(0, 2147483647]"),
    ("max_new_tokens", 2147483648, "(0, 2147483647]"),
    ("max_new_tokens", "20", "(0, "),
    ("seed", 0, "(0, 18446744073709551615]"),
    ("seed", 18446744073709551616, "(0, 1844"),
    ("repetition_penalty", 0, "a float > 0.0"),
    ("repetition_penalty", -1.0, "> 0.0"),
    ("typical_p", 0, "(0.0, 1.0]"),
    ("typical_p", 1.01, "(0.0, 1.0]"),
    ("priority", 0, "[1, 5]"),
    ("priority", 6, "[1, 5]"),
    ("priority", 2.5, "[1, 5]"),
    ("timeout", 0, "(0, 3600]"),
    ("timeout", 3601, "(0, 3600]"),
    ("do_sample", "yes", "a boolean"),
    ("details", 1, "a boolean"),
    ("watermark", 0, "boolean"),
    ("ignore_eos", "yes", "boolean"),
    ("speculative", "no", "boolean"),
]


def _body(**params):
    return {"inputs": "hello", "parameters": params}


@pytest.mark.parametrize("name, value", ACCEPTED)
def test_boundary_values_are_accepted(name, value):
    request = parse_infer_body(_body(**{name: value}))
    assert getattr(request.parameters, name) == value


@pytest.mark.parametrize("name, value, valid", REJECTED)
def test_values_outside_are_rejected_naming_parameter_range_and_value(name, value, valid):
    with pytest.raises(InputValidationError) as error:
        parse_infer_body(_body(**{name: value}))
    message = str(error.value)
    assert f"Parameter {name} must be" in message and valid in message
    assert message.endswith(f"but got {value!r}".replace("'", '"').replace("True", "true"))


def test_null_counts_as_absent():
    request = parse_infer_body(
        {"inputs": "x", "stream": None, "parameters": {name: None for name, _ in ACCEPTED}}
    )
    assert request.parameters.max_new_tokens == 20 and request.parameters.priority == 5
    assert request.parameters.timeout == 600 and not request.stream
    assert parse_infer_body({"inputs": "x", "parameters": None}).parameters.details is False


def test_do_sample_decision():
    assert not parse_infer_body(_body()).parameters.sampling
    assert parse_infer_body(_body(temperature=0.7)).parameters.sampling
    assert parse_infer_body(_body(top_k=5)).parameters.sampling
    assert not parse_infer_body(_body(top_k=5, do_sample=False)).parameters.sampling
    assert parse_infer_body(_body(do_sample=True)).parameters.sampling


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        (None, "inputs is required"),
        ("", "non-empty string"),
        (42, "inputs must be"),
        ("x" * (MAX_INPUT_CHARS + 1), f"at most {MAX_INPUT_CHARS} characters, but got"),
        ([], "non-empty list"),
        ([{"type": "pdf", "pdf": "a"}], "inputs[0].type must be one of"),
        ([{"type": "text", "text": ""}], "inputs[0].text must be a non-empty string"),
        (
            [{"type": "image_url", "image_url": "https://x/a.png"}] * 21,
            "at most 20 image_url, video_url and audio_url items in total, but got 21",
        ),
    ],
)
def test_bad_inputs(inputs, fragment):
    with pytest.raises(InputValidationError, match=None) as error:
        parse_infer_body({"inputs": inputs})
    assert fragment in str(error.value)


def test_longest_input_and_twenty_media_are_accepted():
    assert len(parse_infer_body({"inputs": "x" * MAX_INPUT_CHARS}).inputs) == MAX_INPUT_CHARS
    items = [{"type": "text", "text": "look"}] + [
        {"type": "image_url", "image_url": "https://x/a.png"}
    ] * 20
    assert len(parse_infer_body({"inputs": items}).media) == 20


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_body_must_be_an_object(body):
    with pytest.raises(BadRequestError):
        parse_infer_body(body)


def test_wrong_stream_and_parameters_types():
    with pytest.raises(InputValidationError, match="Parameter stream must be a boolean"):
        parse_infer_body({"inputs": "x", "stream": "true"})
    with pytest.raises(InputValidationError, match="Parameter parameters must be a JSON object"):
        parse_infer_body({"inputs": "x", "parameters": [1]})
