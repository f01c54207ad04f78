"""The ``mlflow models serve`` scoring protocol, as pure functions: body -> rows and settings.

A body with a top-level ``messages``, ``prompt`` or ``input`` is the unified LLM body: one row,
answered with the bare prediction. Otherwise it holds exactly one of the four envelopes
(``dataframe_split``, ``dataframe_records``, ``instances``, ``inputs``), optionally ``params``,
and is answered ``{"predictions": ...}``. As in MLflow, the generation settings of a request are
read from its first row; they override ``params``, which override the model's ``model_config``.
``max_tokens`` is ``max_new_tokens``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.api.errors import MlflowError, OpenAIError
from coordinator.api.limits import MAX_EMBEDDING_CHARS, MAX_EMBEDDING_INPUTS, over_limit
from coordinator.api.openai_request import openai_sampling
from engine.sampling_params import SamplingParams

ENVELOPES = ("dataframe_split", "dataframe_records", "instances", "inputs")
INPUT_COLUMN = {
    "llm/v1/chat": "messages",
    "llm/v1/completions": "prompt",
    "llm/v1/embeddings": "input",
}
GENERATION_SETTINGS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "do_sample",
        "repetition_penalty",
        "seed",
        "stop",
        "n",
        "stream",
    }
)
DEFAULT_MAX_NEW_TOKENS = {"llm/v1/chat": 512, "llm/v1/completions": 16}


@dataclass
class Scoring:
    """One parsed /invocations body."""

    inputs: list[Any]  # one per row: messages, a prompt, or embedding input(s)
    settings: dict[str, Any] = field(default_factory=dict)  # params < first row's fields
    bare: bool = False  # the unified LLM body: answer without the predictions envelope


def parse_scoring(body: Any, task: str) -> Scoring:
    if not isinstance(body, dict):
        raise MlflowError(f"the request body must be a JSON object, got {type(body).__name__}")
    column = INPUT_COLUMN[task]
    if any(key in body for key in INPUT_COLUMN.values()) and not set(body) & set(ENVELOPES):
        return _scoring([dict(body)], column, {}, bare=True)
    present = [key for key in ENVELOPES if key in body]
    if len(present) != 1:
        raise MlflowError(
            "The input must be a JSON dictionary with exactly one of the input fields "
            f"{set(ENVELOPES)} (or a top-level {column!r} for this {task} model). "
            f"Received dictionary with input fields: {sorted(body)}."
        )
    params = body.get("params") or {}
    if not isinstance(params, dict):
        raise MlflowError(f"'params' must be a JSON object, got {json.dumps(params)}")
    return _scoring(_rows(present[0], body[present[0]], column), column, params)


def _scoring(rows: list[dict], column: str, params: dict, bare: bool = False) -> Scoring:
    if not rows:
        raise MlflowError("the input holds no rows")
    missing = [i for i, row in enumerate(rows) if row.get(column) is None]
    if missing:
        raise MlflowError(
            f"this model takes {column!r} as input; row {missing[0]} has none "
            f"(fields: {sorted(rows[missing[0]])})"
        )
    first = {k: v for k, v in rows[0].items() if k != column and v is not None}
    return Scoring([row[column] for row in rows], {**params, **first}, bare)


def _rows(envelope: str, value: Any, column: str) -> list[dict]:
    if envelope == "dataframe_split":
        if not isinstance(value, dict) or not isinstance(value.get("data"), list):
            raise MlflowError('\'dataframe_split\' must be {"columns": [...], "data": [[...]]}')
        columns = value.get("columns") or [column]
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise MlflowError(
                f"'dataframe_split' columns must be a list of column names, got "
                f"{json.dumps(columns)[:200]}"
            )
        if not all(isinstance(r, list) and len(r) == len(columns) for r in value["data"]):
            raise MlflowError(f"every 'dataframe_split' data row must have {len(columns)} values")
        return [dict(zip(columns, r, strict=True)) for r in value["data"]]
    if envelope == "dataframe_records" or isinstance(value, list):
        if not isinstance(value, list):
            raise MlflowError(f"'{envelope}' must be a list of records")
        return [r if isinstance(r, dict) else {column: r} for r in value]
    if isinstance(value, dict):
        return _columns_to_rows(value, column)
    return [{column: value}]


def _columns_to_rows(columns: dict, column: str) -> list[dict]:
    """Columnar ``inputs``/``instances``: ``{"prompt": ["a", "b"], "temperature": 0.5}``."""
    main = columns.get(column)
    if column == "messages" and isinstance(main, list) and main and isinstance(main[0], dict):
        main = [main]  # one conversation, not a column of them
    if column == "input" or not isinstance(main, list):
        main = [main]
    rows = []
    for i, value in enumerate(main):
        row = {column: value}
        for key, other in columns.items():
            if key != column:
                aligned = isinstance(other, list) and len(other) == len(main)
                row[key] = other[i] if aligned else other
        rows.append(row)
    return rows


def merged_settings(model_config: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """model_config (saved < load-time) < the request's params and fields; max_tokens mapped."""
    merged: dict[str, Any] = {}
    for source in (model_config, request):
        for key, value in source.items():
            merged["max_new_tokens" if key == "max_tokens" else key] = value
    return merged


def generation_params(
    settings: dict[str, Any], task: str, vocab_size: int, saved: frozenset[str] = frozenset()
) -> SamplingParams:
    """Sampling from merged settings; sampling is on when ``do_sample`` or a temperature > 0 is
    given (greedy otherwise). Unknown request keys are INVALID_PARAMETER_VALUE; unknown keys of
    the saved config (``saved``) were warned about at start-up and are skipped."""
    unknown = sorted(set(settings) - GENERATION_SETTINGS - saved)
    if unknown:
        raise MlflowError(
            f"unsupported parameter {unknown[0]!r}; supported: "
            f"{', '.join(sorted(GENERATION_SETTINGS | {'max_tokens'}))}",
            "INVALID_PARAMETER_VALUE",
        )
    sampling = _sampling(settings)
    body = {k: settings.get(k) for k in ("top_p", "top_k", "repetition_penalty", "seed", "stop")}
    body["n"] = settings.get("n")
    body["max_tokens"] = settings.get("max_new_tokens")
    body["temperature"] = settings.get("temperature")
    try:
        params = openai_sampling(body, vocab_size, DEFAULT_MAX_NEW_TOKENS[task])
    except OpenAIError as exc:
        message = exc.message.replace("'max_tokens'", "'max_tokens' (max_new_tokens)")
        raise MlflowError(message, "INVALID_PARAMETER_VALUE", exc.status) from exc
    return params if sampling else replace(params, do_sample=False, temperature=1.0)


def _sampling(settings: dict[str, Any]) -> bool:
    """``do_sample``, or when absent whether a temperature > 0 is given."""
    temperature = settings.get("temperature")
    sampling = settings.get("do_sample")
    if sampling is None:
        sampling = isinstance(temperature, int | float) and temperature > 0
    if not isinstance(sampling, bool):
        raise MlflowError(
            f"'do_sample' must be true or false, got {json.dumps(sampling)}",
            "INVALID_PARAMETER_VALUE",
        )
    return sampling


def embedding_texts(inputs: list[Any]) -> list[str]:
    texts = [t for value in inputs for t in (value if isinstance(value, list) else [value])]
    if len(texts) > MAX_EMBEDDING_INPUTS:
        message = over_limit("input", "texts", MAX_EMBEDDING_INPUTS, len(texts))
        raise MlflowError(message, "INVALID_PARAMETER_VALUE", 422)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise MlflowError(
            "'input' must be a non-empty string or a list of non-empty strings",
            "INVALID_PARAMETER_VALUE",
        )
    longest = max(len(text) for text in texts)
    if longest > MAX_EMBEDDING_CHARS:
        message = over_limit("input", "characters a text", MAX_EMBEDDING_CHARS, longest)
        raise MlflowError(message, "INVALID_PARAMETER_VALUE", 422)
    return texts
