"""A byte-level BPE vocabulary of any size (256 or more), made up rather than learned, for the
random-weight GGUF files of ``benchmarks/llamacpp/random_gguf.py``.

It is written as ``tokenizer.ggml.model = "gpt2"``: the 256 byte symbols of GPT-2's byte alphabet,
then every pair of them, then pairs followed by a third symbol, each new token with the merge that
makes it, and the control tokens last. llama.cpp loads it as it loads Qwen2's and Llama-3's
vocabularies, and transformers builds a byte-level tokenizer from it; every id below the size is a
real token, so random prompts of any id decode and encode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from gguf import TokenType

BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"  # GPT-2 tokenizers add this one when absent
CONTROL_TOKENS = (BOS, EOS)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte], extra = chr(256 + extra), extra + 1
    return [symbols[byte] for byte in range(256)]


@dataclass(frozen=True)
class SyntheticVocab:
    """``tokens`` (ids in order), their ``token_types``, the ``merges`` and the control ids."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int
    eos_token_id: int


def _merged(alphabet: list[str]) -> Iterator[tuple[str, str]]:
    """(token, merge) pairs: every two-symbol token, then three-symbol ones."""
    pairs = [(a, b) for a in alphabet for b in alphabet]
    for a, b in pairs:
        yield a + b, f"{a} {b}"
    for a, b in pairs:
        for c in alphabet:
            yield a + b + c, f"{a + b} {c}"


def synthetic_vocab(size: int) -> SyntheticVocab:
    """A vocabulary of exactly ``size`` tokens, the last two being BOS and EOS."""
    alphabet = byte_alphabet()
    num_merged = size - len(alphabet) - len(CONTROL_TOKENS)
    if num_merged < 0:
        raise ValueError(f"a byte-level vocabulary needs at least 258 tokens, got {size}")
    merged = list(islice(_merged(alphabet), num_merged))
    if len(merged) < num_merged:
        raise ValueError(f"at most {len(alphabet) + len(merged) + 2} tokens, got {size}")
    tokens = [*alphabet, *(token for token, _ in merged), *CONTROL_TOKENS]
    types = [int(TokenType.NORMAL)] * (size - 2) + [int(TokenType.CONTROL)] * 2
    return SyntheticVocab(tokens, types, [merge for _, merge in merged], size - 2, size - 1)
