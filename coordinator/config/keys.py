"""One key of ``ms_coordinator.json`` (:class:`Key`) and the dataclass field it feeds
(:class:`Feed`).

A key parses a JSON value (the file, the command line) or a text (the environment) by its kind,
and refuses a wrong one with a :class:`ConfigError` naming ``section.key``, the valid range and
the value received (for a ``secret`` key, such as an API key list, only the received value's type
and length, never the value). A key that feeds a field of ``ClusterConfig`` (or ``RoutingConfig``,
``Timeouts``, ``ModelInfo``) takes its default, and its range where the field is ``bounded``,
from that field (:func:`fed`), so each default is written once; :func:`build` makes the
dataclass from the fed values.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, TypeVar

from engine.errors import ConfigError

T = TypeVar("T")
Convert = Callable[[str, Any, Any], Any]  # (section.key, value, the field's default) -> field
KIND_TEXT = {
    "bool": "true or false",
    "ip": "an IP address",
    "list": "a list of strings",
    "str": "a string",
    "dict": "a JSON object",
}
TRUE_TEXT, FALSE_TEXT = ("true", "1"), ("false", "0")


def field_at(cls: type, path: str) -> Field:
    """The field of dataclass ``cls`` at dotted ``path`` (through nested dataclass fields)."""
    head, _, rest = path.partition(".")
    found = {f.name: f for f in fields(cls)}[head]
    return field_at(type(_default(found)), rest) if rest else found


def _default(found: Field) -> Any:
    factory = found.default_factory
    return found.default if factory is MISSING else factory()


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls`` with the fields ``values`` names by dotted path; a nested dataclass field is
    built the same way, from its own defaults and the values below it."""
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            own[head] = value
    for head, below in nested.items():
        own[head] = build(type(_default(field_at(cls, head))), below)
    return cls(**own)


@dataclass(frozen=True)
class Feed:
    """The field a key sets: ``path`` (dotted) in dataclass ``target``; ``convert`` turns the
    key's value into the field's (default: as it is)."""

    target: type
    path: str
    convert: Convert | None = None

    @property
    def field(self) -> Field:
        return field_at(self.target, self.path)

    @property
    def default(self) -> Any:
        return _default(self.field)

    def value(self, dotted: str, value: Any) -> Any:
        return self.convert(dotted, value, self.default) if self.convert else value


@dataclass(frozen=True)
class Key:
    """One key: its ``kind`` (``int``, ``port``, ``float``, ``bool``, ``str``, ``ip``, ``list``,
    ``dict``), default, range or choices, ``unit`` and one line of ``doc``; ``feeds``: the field
    it sets; ``default_by``: (``section.key``, {its value: default}) when the file leaves it
    out (``default`` is then None); ``secret``: its value is never written into an error."""

    name: str
    kind: str
    default: Any
    doc: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    unit: str = ""
    feeds: Feed | None = None
    default_by: tuple[str, Mapping[str, Any]] | None = None
    secret: bool = False
    section: str = ""  # set by coordinator.config.schema.section()

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_name(self) -> str:
        """``PDSERVE_<SECTION>__<KEY>``, upper case."""
        return f"PDSERVE_{self.section.upper()}__{self.name.upper()}"

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.low is not None and self.high is not None:
            if self.kind in ("int", "port"):
                return f"an integer in [{int(self.low)}, {int(self.high)}]"
            return f"a number in [{self.low:g}, {self.high:g}]"
        return KIND_TEXT[self.kind]

    def parse(self, name: str, value: Any) -> Any:
        """``value`` (JSON) as this key's type; a ConfigError naming ``name`` if it is not."""
        try:
            parsed = _convert(self.kind, value)
        except (TypeError, ValueError):
            parsed = None
        if (
            parsed is None
            or (self.choices and parsed not in self.choices)
            or (self.low is not None and not self.low <= parsed <= self.high)
        ):
            received = value_shape(value) if self.secret else json.dumps(value)
            raise ConfigError(f"{name} must be {self.describe()}, got {received}")
        return parsed

    def parse_text(self, name: str, text: str) -> Any:
        """``text`` (an environment variable) read by this key's kind, then :meth:`parse`."""
        return self.parse(name, _from_text(self.kind, text))


def value_shape(value: Any) -> str:
    """What ``value`` is, without what it holds: its JSON type, its length, and for a list the
    types of its items (``a list of length 2 holding number, string``)."""
    shape = _json_type(value)
    if isinstance(value, str | list | dict):
        shape += f" of length {len(value)}"
    if isinstance(value, list) and value:
        shape += " holding " + ", ".join(sorted({_json_type(item) for item in value}))
    return f"a {shape}" if shape[0] not in "aeiou" else f"an {shape}"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object" if isinstance(value, dict) else type(value).__name__


def _convert(kind: str, value: Any) -> Any:
    if kind == "bool":
        return value if isinstance(value, bool) else None
    if kind in ("int", "port"):
        if isinstance(value, bool | float):
            return None
        if kind == "port" and isinstance(value, str) and value.isdigit():
            return int(value)
        return value if isinstance(value, int) else None
    if kind == "float":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if number else None
    if kind == "ip":
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
    if kind == "dict":
        return value if isinstance(value, dict) else None
    if kind == "list":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return tuple(value) if ok else None
    return value if isinstance(value, str) else None


def _from_text(kind: str, text: str) -> Any:
    """The JSON value ``text`` stands for, by ``kind``; the text itself when it is none."""
    stripped = text.strip()
    if kind == "bool" and stripped.lower() in (*TRUE_TEXT, *FALSE_TEXT):
        return stripped.lower() in TRUE_TEXT
    if kind in ("int", "port", "float", "dict") or (kind == "list" and stripped.startswith("[")):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return text
    if kind == "list":
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def fed(name: str, kind: str, feed: Feed, doc: str, **options: Any) -> Key:
    """A key whose default, and range (choices) where the field is ``bounded`` (a ``choice``),
    are those of the field it feeds (an integer key feeding a float field: the default as an
    integer; with ``default_by``: None, the default then depends on another key). A key may
    narrow a field's choices, never widen them."""
    default = None if "default_by" in options else feed.default
    if kind == "int" and isinstance(default, float) and default.is_integer():
        default = int(default)
    bounds, choices = feed.field.metadata.get("range"), feed.field.metadata.get("choices", ())
    if bounds and {"low", "high"} & set(options):
        raise ValueError(f"{name}: the range is the field's own, {bounds}")
    if choices and not set(options.setdefault("choices", choices)) <= set(choices):
        raise ValueError(f"{name}: the choices must be among the field's own, {choices}")
    low, high = bounds or (options.pop("low", None), options.pop("high", None))
    return Key(name, kind, default, doc, low, high, feeds=feed, **options)
