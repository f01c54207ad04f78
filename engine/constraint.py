"""What a constrained request asks its output to match: a JSON object, a JSON schema, a regex or a
Lark grammar (:class:`Constraint`, part of ``SamplingParams``).

A constraint is only its spec: plain data that crosses every process boundary with the request
(Ray, the KV hand-off's state, a migration). Each engine compiles it itself
(``engine/grammars.py``) and replays the request's tokens so far through the compiled matcher,
so the grammar's state is a pure function of (spec, accepted tokens) wherever the request runs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

KINDS = ("json_object", "json_schema", "regex", "lark")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar past this is refused before compiling


@dataclass(frozen=True)
class Constraint:
    """``kind`` one of :data:`KINDS`; ``spec``: the schema as JSON text (``json_schema``), the
    regex, the Lark grammar, or "" (``json_object``: any JSON object)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            size = len(self.spec) if isinstance(self.spec, str) else type(self.spec).__name__
            raise ConfigError(
                f"constraint spec must be a string of at most {MAX_SPEC_CHARS} chars, got {size}"
            )

    @property
    def key(self) -> str:
        """A digest of the spec: the compiled-grammar cache's key (with the tokenizer's)."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Constraint | None:
        return None if data is None else cls(data["kind"], data.get("spec", ""))
