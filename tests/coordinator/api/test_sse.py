"""Every streamed event's JSON: orjson writes the bytes the standard library's compact, UTF-8
encoding writes, for what a stream carries (a float in exponent form is spelled differently,
``1.5e-7`` for ``1.5e-07``: the same number to every JSON reader)."""

import json

import numpy as np
import pytest

from coordinator.api.sse import DATA_NO_SPACE, dumps, sse_event

PAYLOADS = [
    {"token": {"id": 7, "text": " café ☕ 日本"}, "prefill_time": 12.345, "decode_time": None},
    {"choices": [{"index": 0, "delta": {"content": '"quoted"\n\ttab\\'}, "logprobs": None}]},
    {"generated_text": "", "details": {"finish_reason": "length", "seed": 2**63 - 1}},
    {"usage": {"prompt_tokens": 0, "ratio": 0.1, "time": 1733390000.125, "neg": -2.5}},
    {"text": "\u2028\u2029\x00\x1f\x7f emoji 🙂 and a lone é"},
    {"empty": {}, "list": [], "nested": [[1, [2, [3]]]], "flag": True},
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_orjson_writes_what_the_standard_library_writes(payload):
    written = dumps(payload)
    assert json.loads(written) == payload
    assert written == json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def test_a_float_in_exponent_form_reads_back_the_same():
    payload = {"small": 1.5e-07, "big": 1e21, "tiny": 5e-324}
    assert json.loads(dumps(payload)) == payload


def test_numpy_scalars_and_float_subclasses_are_numbers_as_json_writes_them():
    class Seconds(float):
        pass

    payload = {"f64": np.float64(1.5), "f32": np.float32(0.25), "i64": np.int64(3)}
    payload["sub"] = Seconds(2.5)
    assert json.loads(dumps(payload)) == {"f64": 1.5, "f32": 0.25, "i64": 3, "sub": 2.5}


def test_an_event_is_one_data_line_and_a_blank_line():
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse_event([1], DATA_NO_SPACE) == b"data:[1]\n\n"


def test_a_lone_surrogate_is_refused_not_sent():
    with pytest.raises(TypeError):
        dumps({"text": "\ud800"})
