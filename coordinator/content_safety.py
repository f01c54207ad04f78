"""A configurable content filter over inputs and generated text (off by default).

Configured in ``ms_coordinator.json``::

    "content_safety": {"enabled": true, "categories": {
        "violence": {"terms": ["kill"], "patterns": ["\\\\bshoot(ing)?\\\\b"]}}}

Terms match whole words, case-insensitively; patterns are Python regular expressions (also
case-insensitive). A blocked input is refused with 400 ``content_filter`` on every generation
route (:func:`text_blocked`); a blocked output of an OpenAI, Azure or MLflow answer is cut
before the match and ends with ``finish_reason: "content_filter"``. While streaming, text is
checked before it is sent, so a completed match is never sent (the first characters of a term
spanning two tokens may be).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.errors import ConfigError

INPUT_FILTERED = "The input was filtered by the content safety policy"


@dataclass(frozen=True)
class ContentFilter:
    patterns: tuple[tuple[str, re.Pattern], ...]  # (category, compiled)

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> ContentFilter | None:
        if not section.get("enabled"):
            return None
        compiled = []
        for category, rules in section.get("categories", {}).items():
            if not isinstance(rules, dict):
                raise ConfigError(f"content_safety.categories.{category} must be an object")
            for term in rules.get("terms", []):
                compiled.append((category, re.compile(rf"\b{re.escape(term)}\b", re.I)))
            for pattern in rules.get("patterns", []):
                try:
                    compiled.append((category, re.compile(pattern, re.I)))
                except re.error as exc:
                    raise ConfigError(
                        f"content_safety.categories.{category}.patterns: "
                        f"{pattern!r} is not a valid regular expression: {exc}"
                    ) from exc
        return cls(tuple(compiled))

    def search(self, text: str) -> re.Match | None:
        """The earliest match of any category in ``text``."""
        matches = [m for _, p in self.patterns if (m := p.search(text))]
        return min(matches, key=lambda m: m.start(), default=None)


def text_blocked(content_filter: ContentFilter | None, text: str) -> bool:
    """Whether ``content_filter`` (None: content safety is off) blocks ``text``."""
    return content_filter is not None and content_filter.search(text) is not None
