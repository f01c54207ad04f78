"""transformers' float32 image of a GGUF file (its own conversion, cached once): the reference
the engine's reading of the file is checked against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model.gguf_cache import converted_dir_for


def transformers_image(gguf_path: Path) -> dict[str, torch.Tensor]:
    """Every tensor transformers makes of ``gguf_path``, by Hugging Face name."""
    folder = converted_dir_for(gguf_path)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors
