"""Constraints as the tests write them."""

from __future__ import annotations

import json
from typing import Any

from engine.constraint import Constraint


def json_schema(schema: dict[str, Any]) -> Constraint:
    """A schema as its canonical JSON text (as the doors write it: equal schemas share one
    compiled grammar)."""
    return Constraint("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
