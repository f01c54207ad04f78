"""A TGI request body, validated: every parameter TGI's API defines is honoured or refused.

Honoured: ``temperature``, ``top_k``, ``top_p``, ``typical_p``, ``do_sample``,
``max_new_tokens``, ``seed``, ``repetition_penalty``, ``details`` (validated as MindIE's,
:mod:`~coordinator.api.mindie_request`), ``stop``, ``grammar``
(:mod:`~coordinator.api.structured_request`), ``frequency_penalty`` ([-2, 2], OpenAI's
formula), ``return_full_text`` (the prompt before the answer's ``generated_text``) and
``truncate`` (only the prompt's last ``truncate`` tokens are kept). Refused with 422 at any
value but "off": ``best_of`` > 1, ``decoder_input_details``, ``adapter_id``, ``watermark``
(no watermarking here). ``top_n_tokens`` (0 to 5, TGI's default bound) lists each token's most
likely alternatives with their log probabilities. Keys TGI does not define are ignored, as
TGI's own server does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from coordinator.api.errors import InputValidationError
from coordinator.api.limits import stop_limit_message
from coordinator.api.mindie_request import InferRequest, parse_infer_body

PARAMETERS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "max_new_tokens",
        "do_sample",
        "seed",
        "repetition_penalty",
        "typical_p",
        "details",
    }
)
OFF_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {  # the values meaning "off"; why not
    "best_of": ((None, 1), "only one candidate is generated"),
    "decoder_input_details": ((None, False), "the prompt's token details are not returned"),
    "adapter_id": ((None,), "no adapters are loaded"),
    "watermark": ((None, False), "outputs are not watermarked"),
}
MAX_TRUNCATE = 2**31 - 1
MAX_TOP_N_TOKENS = 5  # TGI's max_top_n_tokens default


@dataclass(frozen=True)
class TgiRequest:
    request: InferRequest
    stop: tuple[str, ...]
    frequency_penalty: float = 0.0
    return_full_text: bool = False
    truncate: int | None = None  # keep the prompt's last ``truncate`` tokens
    top_n_tokens: int = 0  # alternatives listed for each token


def parse_tgi_body(body: Any, max_chars: int) -> TgiRequest:
    """A TGI body as a MindIE request plus TGI's own parameters; ``inputs`` of at most
    ``max_chars`` characters."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), str):
        raise InputValidationError("inputs must be a non-empty string")
    parameters = body.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InputValidationError(
            f"parameters must be a JSON object, got {json.dumps(parameters)[:200]}"
        )
    raw = dict(parameters or {})
    stop = raw.pop("stop", None) or []
    if isinstance(stop, list) and (over := stop_limit_message("stop", stop)):
        raise InputValidationError(over)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InputValidationError("stop must be a list of non-empty strings")
    _refuse_unsupported(raw)
    known = {k: v for k, v in raw.items() if k in PARAMETERS}
    request = parse_infer_body({"inputs": body["inputs"], "parameters": known}, max_chars=max_chars)
    return TgiRequest(
        request,
        tuple(stop),
        frequency_penalty=_frequency_penalty(raw.get("frequency_penalty")),
        return_full_text=_flag(raw, "return_full_text"),
        truncate=_truncate(raw.get("truncate")),
        top_n_tokens=_top_n_tokens(raw.get("top_n_tokens")),
    )


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    for name, (offs, why_not) in OFF_VALUES.items():
        value = raw.get(name)
        if not any(type(value) is type(off) and value == off for off in offs):
            shown = json.dumps(value)[:64]
            raise InputValidationError(f"{name} is not supported: {why_not}; got {shown}")


def _frequency_penalty(value: Any) -> float:
    if value is None:
        return 0.0
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not -2 <= value <= 2:
        raise InputValidationError(
            f"frequency_penalty must be a number in [-2, 2], got {json.dumps(value)[:64]}"
        )
    return float(value)


def _flag(raw: dict[str, Any], name: str) -> bool:
    value = raw.get(name)
    if value is not None and not isinstance(value, bool):
        raise InputValidationError(f"{name} must be true or false, got {json.dumps(value)[:64]}")
    return bool(value)


def _top_n_tokens(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_N_TOKENS:
        raise InputValidationError(
            f"top_n_tokens must be an integer in [0, {MAX_TOP_N_TOKENS}], "
            f"got {json.dumps(value)[:64]}"
        )
    return value


def _truncate(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TRUNCATE:
        raise InputValidationError(
            f"truncate must be an integer in [1, {MAX_TRUNCATE}], got {json.dumps(value)[:64]}"
        )
    return value
