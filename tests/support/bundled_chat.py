"""The bundled model's chat prompts: what its tests share."""

from __future__ import annotations

MESSAGES = [
    "What is the capital of France?",
    "中国的首都是哪里？",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German.",
]
