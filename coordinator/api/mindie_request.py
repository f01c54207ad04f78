"""Validation of MindIE's ``POST /infer`` body (the rules of ``docs/api.md``), to the letter.

Every rejected value raises :class:`InputValidationError` whose message names the parameter, its
valid range and the value received; the door answers it with 422 and MindIE's body. JSON ``null``
counts as absent; float parameters accept JSON integers; booleans are never numbers.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any

from coordinator.api.errors import BadRequestError, InputValidationError
from coordinator.api.limits import MAX_INPUT_CHARS, over_limit
from engine.sampling_params import MAX_SEED, SamplingParams

INT32_MAX = 2147483647
SEED_MAX = 18446744073709551615
MEDIA_TYPES = ("image_url", "video_url", "audio_url")
MAX_MEDIA_ITEMS = 20
MAX_INPUT_ITEMS = 256  # content items of a list-form ``inputs``, text and media together


@dataclass(frozen=True)
class InferParameters:
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 20
    do_sample: bool | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    details: bool = False
    typical_p: float | None = None
    watermark: bool = False  # accepted, not applied
    ignore_eos: bool = False  # pdserve extension: generate max_new_tokens (benchmarks)
    speculative: bool = True  # pdserve extension: false decodes without drafts (same tokens)
    priority: int = 5
    timeout: int = 600

    @property
    def sampling(self) -> bool:
        """Absent ``do_sample`` samples iff a sampling knob is given (a pdserve decision)."""
        if self.do_sample is not None:
            return self.do_sample
        return any(
            v is not None for v in (self.temperature, self.top_k, self.top_p, self.typical_p)
        )

    def sampling_params(self, vocab_size: int, stop: tuple[str, ...] = ()) -> SamplingParams:
        """The engine's settings; a ``top_k`` past the vocabulary means all of it, and an absent
        seed is drawn here so the answer can echo it."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.sampling,
            temperature=self.temperature or 1.0,
            top_k=min(self.top_k or 0, vocab_size),
            top_p=self.top_p or 1.0,
            typical_p=self.typical_p or 1.0,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed if self.seed is not None else secrets.randbelow(MAX_SEED) + 1,
            stop=stop,
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
        )


@dataclass(frozen=True)
class InferRequest:
    inputs: str | list[dict[str, Any]]
    stream: bool
    parameters: InferParameters
    token_ids: list[int] | None = None  # /infer_token: the prompt as token ids

    @property
    def text(self) -> str:
        """The text of the request (list inputs: their text items joined)."""
        if isinstance(self.inputs, str):
            return self.inputs
        return "".join(item["text"] for item in self.inputs if item["type"] == "text")

    @property
    def media(self) -> list[dict[str, Any]]:
        if isinstance(self.inputs, str):
            return []
        return [item for item in self.inputs if item["type"] != "text"]


def _bad(name: str, valid: str, value: Any) -> InputValidationError:
    shown = json.dumps(value, ensure_ascii=False)[:200]
    return InputValidationError(f"Parameter {name} must be {valid}, but got {shown}")


def _number(params: dict[str, Any], name: str, valid: str, ok: Any, integer: bool) -> Any:
    value = params.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and not isinstance(value, int))
        or (isinstance(value, float) and not math.isfinite(value))
        or not ok(value)
    ):
        raise _bad(name, valid, value)
    return value if integer else float(value)


def _bool(params: dict[str, Any], name: str) -> bool | None:
    value = params.get(name)
    if value is not None and not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


_NUMBERS = {
    "temperature": ("a float > 1e-06", lambda v: v > 1e-6, False),
    "top_k": (f"an integer in (0, {INT32_MAX}]", lambda v: 0 < v <= INT32_MAX, True),
    "top_p": ("a float in (1e-06, 1.0)", lambda v: 1e-6 < v < 1.0, False),
    "max_new_tokens": (f"an integer in (0, {INT32_MAX}]", lambda v: 0 < v <= INT32_MAX, True),
    "seed": (f"an integer in (0, {SEED_MAX}]", lambda v: 0 < v <= SEED_MAX, True),
    "repetition_penalty": ("a float > 0.0", lambda v: v > 0.0, False),
    "typical_p": ("a float in (0.0, 1.0]", lambda v: 0.0 < v <= 1.0, False),
    "priority": ("an integer in [1, 5]", lambda v: 1 <= v <= 5, True),
    "timeout": ("an integer in (0, 3600]", lambda v: 0 < v <= 3600, True),
}
_BOOLS = ("do_sample", "details", "watermark", "ignore_eos", "speculative")


def parse_parameters(raw: Any) -> InferParameters:
    if raw is None:
        return InferParameters()
    if not isinstance(raw, dict):
        raise _bad("parameters", "a JSON object", raw)
    values = {name: _number(raw, name, *rule) for name, rule in _NUMBERS.items()}
    values |= {name: _bool(raw, name) for name in _BOOLS}
    return InferParameters(**{name: v for name, v in values.items() if v is not None})


def parse_inputs(raw: Any, max_chars: int = MAX_INPUT_CHARS) -> str | list[dict[str, Any]]:
    """``inputs``: a string of 1 to ``max_chars`` characters, or a list of content items whose
    texts hold ``max_chars`` in all."""
    if raw is None:
        raise InputValidationError("Parameter inputs is required, but it is missing or null")
    if isinstance(raw, str):
        return _text(raw, max_chars)
    if isinstance(raw, list):
        items = _parse_items(raw)
        chars = sum(len(item["text"]) for item in items if item["type"] == "text")
        if chars > max_chars:
            message = over_limit("Parameter inputs", "text characters", max_chars, chars)
            raise InputValidationError(message)
        return items
    raise _bad("inputs", "a non-empty string or a list of content items", raw)


def _parse_items(items: list[Any]) -> list[dict[str, Any]]:
    if not items:
        raise InputValidationError("Parameter inputs must be a non-empty list, but got []")
    if len(items) > MAX_INPUT_ITEMS:
        raise InputValidationError(
            over_limit("Parameter inputs", "items", MAX_INPUT_ITEMS, len(items))
        )
    kinds = ("text", *MEDIA_TYPES)
    for index, item in enumerate(items):
        where = f"inputs[{index}]"
        if not isinstance(item, dict) or item.get("type") not in kinds:
            raise _bad(
                f"{where}.type",
                "one of " + ", ".join(kinds),
                item.get("type") if isinstance(item, dict) else item,
            )
        kind = item["type"]
        value = item.get(kind)
        if not isinstance(value, str) or not value:
            raise _bad(f"{where}.{kind}", "a non-empty string", value)
    media = sum(item["type"] != "text" for item in items)
    if media > MAX_MEDIA_ITEMS:
        raise InputValidationError(
            f"Parameter inputs may hold at most {MAX_MEDIA_ITEMS} image_url, video_url and "
            f"audio_url items in total, but got {media}"
        )
    return items


def parse_infer_body(
    body: Any, *, input_id: bool = False, max_chars: int = MAX_INPUT_CHARS
) -> InferRequest:
    """Validate a decoded JSON body; ``input_id=True`` for ``/infer_token``; ``max_chars``: the
    prompt's character cap (:func:`~coordinator.api.limits.prompt_char_limit`)."""
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    token_ids = parse_token_ids(body.get("input_id")) if input_id else None
    inputs = "" if input_id else parse_inputs(body.get("inputs"), max_chars)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "a boolean", stream)
    return InferRequest(inputs, bool(stream), parse_parameters(body.get("parameters")), token_ids)


def parse_token_ids(raw: Any) -> list[int]:
    if (
        not isinstance(raw, list)
        or not raw
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw)
    ):
        raise _bad("input_id", "a non-empty list of token ids (integers >= 0)", raw)
    return raw


def parse_tokenizer_body(body: Any, max_chars: int = MAX_INPUT_CHARS) -> str:
    """The text of a ``/v1/tokenizer`` body ``{"inputs": str}``, of at most ``max_chars``."""
    inputs = body.get("inputs") if isinstance(body, dict) else None
    if not isinstance(inputs, str) or not inputs:
        raise InputValidationError(
            f"Parameter inputs must be a non-empty string, but got {json.dumps(inputs)[:200]}"
        )
    return _text(inputs, max_chars)


def _text(text: str, max_chars: int) -> str:
    """A string ``inputs``: 1 to ``max_chars`` characters."""
    if not 0 < len(text) <= max_chars:
        raise InputValidationError(
            f"Parameter inputs must be a non-empty string of at most {max_chars} "
            f"characters, but got {len(text)} characters"
        )
    return text
