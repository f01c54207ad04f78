"""What a request asks its output to match, read from each door's fields into an
:class:`~engine.constraint.Constraint`, and compiled once at the door so a spec that cannot
compile is the client's 4xx before any worker sees it.

Fields (``docs/api.md`` "Structured outputs"):

- ``response_format`` (OpenAI chat and completions, Azure chat): ``{"type": "text"}`` (none),
  ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``. A strict schema compiles exactly (a keyword the grammar library
  does not implement is refused); a non-strict one ignores such keywords.
- vLLM's extensions, on both OpenAI routes: ``structured_outputs: {"json" | "regex" | "choice" |
  "grammar": ...}`` and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (a Lark grammar); at most one of them, and not with a ``response_format``
  other than text.
- TGI's ``parameters.grammar``: ``{"type": "json", "value": <schema>}`` or ``{"type": "regex",
  "value": "<regex>"}`` (:func:`tgi_constraint`).

A spec the door has not compiled before takes one from its client's compiles a minute
(``request_limit.grammar_compiles_per_minute_per_key``; past it, 429 with ``Retry-After``).
Every refusal is a :class:`FormatError` naming the field; each door answers it in its own shape
(``unsupported``: a ``type`` this server does not know, Azure's 422 ``parameter_not_supported``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from coordinator.api.chat_prompt import shown
from coordinator.api.clients import UNLIMITED, Client
from coordinator.api.errors import APIError, FormatError
from coordinator.errors import TooManyRequests
from coordinator.model_info import ModelInfo
from engine.constraint import MAX_SPEC_CHARS, Constraint
from engine.errors import ConfigError
from engine.grammars import GrammarError

FORMAT_TYPES = ("text", "json_object", "json_schema")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a schema's name, and a tool's
GUIDED = {  # vLLM's guided_* field -> its structured_outputs key
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
MAX_CHOICES = 256  # a choice list past this is refused (it compiles to one alternation)


def request_constraint(body: dict, extensions: bool = True) -> Constraint | None:
    """The constraint of an OpenAI-style body: its ``response_format``, or (``extensions``)
    one of vLLM's fields. None: free text."""
    constraint = response_format_constraint(body.get("response_format"))
    named = [name for name in ("structured_outputs", *GUIDED) if body.get(name) is not None]
    if not extensions or not named:
        return constraint
    if len(named) > 1 or constraint is not None:
        fields = ", ".join(named + (["response_format"] if constraint is not None else []))
        raise FormatError(named[0], f"only one structured-output field may be set, got {fields}")
    name = named[0]
    if name == "structured_outputs":
        outputs = body[name]
        keys = (
            [k for k in ("json", "regex", "choice", "grammar") if k in outputs]
            if isinstance(outputs, dict)
            else []
        )
        if len(keys) != 1 or len(outputs) != 1:
            raise FormatError(
                name,
                "'structured_outputs' must be an object with exactly one of json, regex, choice, "
                f"grammar; got {shown(outputs)}",
                outputs,
            )
        return _extension(f"{name}.{keys[0]}", keys[0], outputs[keys[0]])
    return _extension(name, GUIDED[name], body[name])


def response_format_constraint(value: Any) -> Constraint | None:
    """``response_format``'s constraint (None for absent or ``text``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FormatError(
            "response_format",
            f"'response_format' must be an object with a 'type' (one of "
            f"{', '.join(FORMAT_TYPES)}), got {shown(value)}",
            value,
        )
    kind = value["type"]
    if kind not in FORMAT_TYPES:
        raise FormatError(
            "response_format.type",
            f"'response_format.type' must be one of {', '.join(FORMAT_TYPES)}, got {shown(kind)}",
            value,
            unsupported=True,
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    return _json_schema_format(value.get("json_schema"))


def _json_schema_format(spec: Any) -> Constraint:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise FormatError(param, f"'{param}' must be an object, got {shown(spec)}", spec)
    checked_name(f"{param}.name", spec.get("name"), FormatError)
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise FormatError(f"{param}.strict", f"'{param}.strict' must be true or false", strict)
    schema = spec.get("schema", {})
    return schema_constraint(f"{param}.schema", schema, strict)


def checked_name(param: str, name: Any, error: Callable[[str, str, Any], Exception]) -> str:
    """``name`` when it is a :data:`NAME` (a schema's, a tool's), else ``error(param, message,
    name)`` raised."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        valid = "1 to 64 characters of a-z, A-Z, 0-9, _ and -"
        raise error(param, f"'{param}' must be {valid}, got {shown(name)}", name)
    return name


def schema_constraint(param: str, schema: Any, strict: bool) -> Constraint:
    """A JSON schema (an object, or its JSON text) as a constraint; a non-strict schema ignores
    keywords the grammar library does not implement."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise _too_large(param, len(schema))
        try:
            schema = json.loads(schema)
        except ValueError:
            raise FormatError(param, f"'{param}' is not valid JSON", None) from None
    if not isinstance(schema, dict | bool):
        raise FormatError(param, f"'{param}' must be a JSON schema object, got {shown(schema)}")
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not strict:
        guidance = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {"lenient": True, **(guidance or {})}}
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_SPEC_CHARS:
        raise _too_large(param, len(text))
    return Constraint("json_schema", text)


def _extension(param: str, key: str, value: Any) -> Constraint:
    if key == "json":
        return schema_constraint(param, value, strict=False)
    if key == "choice":
        ok = isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in value):
            raise FormatError(
                param,
                f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty strings, "
                f"got {shown(value)}",
                value,
            )
        return _text_constraint(param, "regex", "|".join(re.escape(c) for c in value))
    if not isinstance(value, str) or not value:
        raise FormatError(param, f"'{param}' must be a non-empty string, got {shown(value)}")
    return _text_constraint(param, "regex" if key == "regex" else "lark", value)


def _text_constraint(param: str, kind: str, spec: str) -> Constraint:
    if len(spec) > MAX_SPEC_CHARS:
        raise _too_large(param, len(spec))
    return Constraint(kind, spec)


def _too_large(param: str, size: int) -> FormatError:
    return FormatError(param, f"'{param}' must be at most {MAX_SPEC_CHARS} characters, got {size}")


def tgi_constraint(grammar: Any) -> Constraint | None:
    """TGI's ``parameters.grammar``: ``{"type": "json" | "regex", "value"}`` (None: absent)."""
    if grammar is None:
        return None
    if not isinstance(grammar, dict) or grammar.get("type") not in ("json", "regex"):
        raise FormatError(
            "grammar",
            f'grammar must be {{"type": "json" | "regex", "value": ...}}, got {shown(grammar)}',
            grammar,
        )
    if grammar["type"] == "json":
        return schema_constraint("grammar.value", grammar.get("value"), strict=False)
    return _extension("grammar.value", "regex", grammar.get("value"))


def charge_compile(model: ModelInfo, constraint: Constraint, client: Client) -> None:
    """Take one from ``client``'s bucket of compiles a minute when the door has not compiled
    (or refused) ``constraint`` before; past it, a 429 :class:`APIError` with ``Retry-After``."""
    if model.grammar_cache().known(constraint):
        return
    try:
        client.limits.compiles.take(client.key, 1)
    except TooManyRequests as exc:
        client.limits.on_refusal()
        raise APIError.from_service(exc) from exc


async def check_compiles(
    model: ModelInfo, constraint: Constraint | None, param: str, client: Client = UNLIMITED
) -> None:
    """Compile ``constraint`` against the served tokenizer, off the loop (cached per spec: a
    spec seen before costs a lookup, a new one one of ``client``'s compiles a minute,
    :func:`charge_compile`); :class:`FormatError` naming ``param`` when it does not."""
    if constraint is None:
        return
    charge_compile(model, constraint, client)
    try:
        await run_in_threadpool(model.grammar_cache().compile, constraint)
    except (GrammarError, ConfigError) as exc:
        raise FormatError(param, f"'{param}': {exc}") from exc


def constraint_param(body: dict) -> str:
    """The field a door names when a body's constraint does not compile."""
    for name in ("structured_outputs", *GUIDED):
        if body.get(name) is not None:
            return name
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"
