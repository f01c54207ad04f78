"""The GGUF files the engine benchmark runs on, by name.

``bundled`` is the bundled SmolLM2-135M Q4_1 file; ``bundled-<type>`` its llama-quantize copy in
``<type>`` (``bundled-q4_k_m``, ``bundled-q5_k_m``, ``bundled-q6_k``, ``bundled-q8_0``);
``<preset>-<type>`` a random-weight file of ``benchmarks/llamacpp/random_gguf.py``'s preset
(``1b-q4_k_m``, ``0.5b-q4_k_m``, ``3b-q4_k_m``; ``<preset>-f16`` is the written file itself). A
name's file is made on first use and kept in the cache folder; anything else is taken as the path of
a ``.gguf`` file.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.llamacpp.random_gguf import PRESETS, random_gguf_path
from benchmarks.llamacpp.requantize import requantized_path
from engine.model.gguf_cache import bundled_gguf_path

NAMED_SETS = (
    "bundled",
    "bundled-q4_k_m",
    "bundled-q5_k_m",
    "bundled-q6_k",
    "bundled-q8_0",
    "1b-q4_k_m",
    "0.5b-q4_k_m",
    "3b-q4_k_m",
)


def _base(name: str) -> Path:
    return bundled_gguf_path() if name == "bundled" else random_gguf_path(name)


def is_named(name: str) -> bool:
    base, _, _ = name.partition("-")
    return name == "bundled" or (base in ("bundled", *PRESETS) and "-" in name)


def resolve_gguf(name: str) -> Path:
    """The file a set name (or a path) stands for, made first when it is a name not yet made."""
    if not is_named(name):
        path = Path(name).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(f"{name!r} is neither a set ({', '.join(NAMED_SETS)}) nor a .gguf")
        return path
    base, _, quant_type = name.partition("-")
    if not quant_type or (base != "bundled" and quant_type == "f16"):
        return _base(base)
    return requantized_path(_base(base), quant_type)
