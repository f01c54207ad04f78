"""The limits on what a client controls, in one place (``docs/api.md`` lists them).

Each is checked as soon as the request is read, before it costs memory or time; an over-limit
request is answered 422 in the door's error shape, with a message naming the parameter, its limit
and the value received (:func:`over_limit`). The body itself is bounded while it is read
(``request_limit.body_limit``, 413; :func:`~coordinator.api.common.read_body`).
"""

from __future__ import annotations

from collections.abc import Sized

MAX_STOP_SEQUENCES = 4  # stop strings of one request (OpenAI, Azure, TGI, MLflow)
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_MESSAGES = 2048  # chat messages of one request (OpenAI, Azure, MLflow chat)
MAX_EMBEDDING_INPUTS = 2048  # texts of one embeddings request
MAX_EMBEDDING_CHARS = 128 * 1024  # characters of one of them (16 for each of 8192 tokens)
MAX_INVOCATION_ROWS = 64  # rows of one /invocations request (and never more than max_requests)
MAX_INPUT_CHARS = 4 * 1024 * 1024  # characters of any prompt, whatever the model allows
MAX_INPUT_TOKENS = 1024 * 1024  # tokens of any prompt, whatever the model allows
# a prompt's characters are capped before it is tokenized, at this many per token of the
# model's prompt limit (English text runs about 4 a token; a longer prompt could only fit in
# the limit as long runs of one character)
CHARS_PER_TOKEN = 16
# the default body limit: the largest legal prompt, each character escaped as \uXXXX, plus a
# megabyte of the rest of the body (messages, parameters)
ESCAPED_CHAR_BYTES = 6


def prompt_char_limit(max_input_tokens: int) -> int:
    """The most characters of one prompt, before tokenizing, for a model taking
    ``max_input_tokens`` tokens."""
    return min(CHARS_PER_TOKEN * max_input_tokens, MAX_INPUT_CHARS)


def default_body_limit_mb(max_input_tokens: int) -> int:
    """``request_limit.body_limit`` when the file leaves it at 0: what the largest legal
    prompt needs (:data:`ESCAPED_CHAR_BYTES` per character, rounded up) plus 1 MB."""
    prompt_bytes = prompt_char_limit(max_input_tokens) * ESCAPED_CHAR_BYTES
    return -(-prompt_bytes // (1024 * 1024)) + 1


def prompt_chars_message(name: str, chars: int, max_input_tokens: int) -> str | None:
    """Why a prompt of ``chars`` characters is refused before tokenizing, or None."""
    limit = prompt_char_limit(max_input_tokens)
    if chars <= limit:
        return None
    return over_limit(name, f"characters ({CHARS_PER_TOKEN} per prompt token)", limit, chars)


def over_limit(name: str, what: str, limit: int, received: int) -> str:
    """The message of an over-limit refusal, e.g. ``stop may hold at most 4 strings, but got
    10000``."""
    return f"{name} may hold at most {limit} {what}, but got {received}"


def count_over(name: str, what: str, value: Sized, limit: int) -> str | None:
    """:func:`over_limit`'s message when ``value`` holds more than ``limit`` items, else None."""
    return over_limit(name, what, limit, len(value)) if len(value) > limit else None


def stop_limit_message(name: str, stop: list) -> str | None:
    """Why a list of stop strings is over the limits (count, then each string's length), or
    None when it is within them. Strings longer than the limit are reported by index."""
    message = count_over(name, "stop sequences", stop, MAX_STOP_SEQUENCES)
    if message:
        return message
    for index, text in enumerate(stop):
        if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
            return over_limit(f"{name}[{index}]", "characters", MAX_STOP_CHARS, len(text))
    return None
