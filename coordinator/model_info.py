"""The served model as the front doors see it: built by ``coordinator/served_model.py`` from the
configuration, read by every door in ``coordinator/api/``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
