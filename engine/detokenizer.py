"""Incremental detokenization that never emits a broken UTF-8 character, and stop strings.

Each step decodes a short window of recent tokens twice (with and without the newest ones); the
difference is the new text. A window that ends inside a multi-byte character decodes to U+FFFD,
so the text is held back until the character completes. With stop strings, the last
``len(longest stop) - 1`` characters are held back too, so a stop string split across tokens is
never streamed before it is recognised and cut.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5  # tokens of left context for the decode window


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.prefix_offset = max(len(prompt_token_ids) - _WINDOW, 0)
        self.read_offset = len(prompt_token_ids)
        self.text = ""  # all decoded output text (after a stop cut, up to the stop string)
        self.num_emitted_chars = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def append(self, token_ids: list[int]) -> bool:
        """Decode the newest token of ``token_ids`` (the whole sequence). True if a stop matched."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        start = max(len(self.text) - self.holdback, 0)  # a stop may begin in held-back text
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._cut_at_stop(start)

    def _cut_at_stop(self, search_from: int) -> bool:
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1:
                self.text = self.text[:index]
                return True
        return False

    def take_piece(self, finished: bool) -> str:
        """The text not yet emitted that is safe to emit now."""
        end = len(self.text) if finished else max(len(self.text) - self.holdback, 0)
        end = max(end, self.num_emitted_chars)
        piece = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return piece
