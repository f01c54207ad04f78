"""Drafts for speculative decoding with no model: where the sequence's last tokens occurred
before, the tokens that followed them there (prompt lookup, an n-gram copy).

Much of what is served quotes its input: a summary, an extraction, a code edit, JSON or a tool
call that repeats the prompt. There the next tokens are often a copy of an earlier span, and a
draft of them, checked several at a time against the model, costs one read of the weights for
several tokens. A draft is made from the request's token ids alone (prompt and output so far),
so nothing of it crosses a hand-off and a request that moved to another worker drafts the same
way there.

The match: of every earlier position holding the sequence's last token, the one whose run of
equal tokens going backwards is longest (up to ``max_match``, at least ``min_match``), the
latest among equals; the draft is the tokens after it, at most ``max_draft``. Its cost is one
pass over the tokens (numpy) per draft, and none of it is kept between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError


@dataclass(frozen=True)
class NgramDrafter:
    min_match: int = 2  # tokens of the suffix that must match, at least
    max_match: int = 4  # ... compared, at most (a longer match is no better a guess)
    max_draft: int = 4  # tokens drafted, at most

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise ConfigError(
                f"speculative min_match must be in [1, max_match={self.max_match}], "
                f"got {self.min_match}"
            )
        if self.max_draft < 1:
            raise ConfigError(f"speculative max_draft must be >= 1, got {self.max_draft}")

    def draft(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """At most ``min(max_draft, limit)`` tokens that followed the best earlier match of
        ``token_ids``' suffix (module docstring); [] when nothing matches ``min_match`` tokens."""
        count = self.max_draft if limit is None else min(self.max_draft, limit)
        if count < 1 or len(token_ids) <= self.min_match:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier places of the last token
        lengths = np.ones(ends.size, dtype=np.int64)
        matching = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_match, tokens.size - 1)):
            before = ends - back
            matching &= before >= 0
            matching[matching] = tokens[before[matching]] == tokens[-1 - back]
            lengths += matching
        longest = int(lengths.max()) if ends.size else 0
        if longest < self.min_match:
            return []
        end = ends[np.flatnonzero(lengths == longest)[-1]]
        return tokens[end + 1 : end + 1 + count].tolist()
