"""The served model as the front doors see it: built by ``coordinator/served_model.py`` from the
configuration, read by every door in ``coordinator/api/``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from engine.grammars import GrammarCache


@dataclass
class ModelInfo:
    """What the front doors need to know of the served model."""

    name: str
    tokenizer: Any
    max_position_embeddings: int
    vocab_size: int
    # SchedulerConfig.max_prompt_tokens(max_position_embeddings); /infer caps it at 1 Mi too
    max_input_tokens: int
    full_text_enabled: bool = False
    modalities: tuple[str, ...] = ("text",)
    allowed_media_dirs: tuple[str, ...] = ()
    content_filter: Any = None  # a ContentFilter when content_safety is enabled
    # constraints compiled at the door (coordinator/api/structured_request.py), made on first use
    grammars: GrammarCache | None = field(default=None, repr=False)
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)  # at most the vocab

    def token_text(self, token_id: int) -> str:
        """One token's text, as the tokenizer decodes it alone (log probabilities name tokens
        by it); remembered, so each id is decoded once."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text

    def grammar_cache(self) -> GrammarCache:
        """The compiled-constraint cache over the served tokenizer (built on first use)."""
        with self._grammars_lock:
            if self.grammars is None:
                eos = getattr(self.tokenizer, "eos_token_id", None)
                self.grammars = GrammarCache(
                    self.tokenizer, self.vocab_size, [eos] if eos is not None else []
                )
            return self.grammars
