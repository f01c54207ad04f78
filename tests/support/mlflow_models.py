"""MLflow model directories written by the real ``mlflow.transformers.save_model``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

CHAT_NAME = "tiny-org/tiny-chat"
EMBED_NAME = "tiny-org/tiny-embed"
SAVED_CONFIG = {"max_new_tokens": 6, "do_sample": False, "repetition_penalty": 1.0}


def save_llm(hf_dir: Path, path: Path, task: str, name: str = CHAT_NAME, **kwargs) -> Path:
    """Save the HF model in ``hf_dir`` as an MLflow ``task`` model under ``path``."""
    import mlflow.transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    model.name_or_path = name
    mlflow.transformers.save_model(
        transformers_model={"model": model, "tokenizer": AutoTokenizer.from_pretrained(hf_dir)},
        path=str(path),
        task=task,
        pip_requirements=["transformers"],
        **kwargs,
    )
    return path


def save_encoder(path: Path) -> Path:
    """A tiny random BERT saved as an MLflow ``llm/v1/embeddings`` model."""
    import mlflow.transformers
    from transformers import BertConfig, BertModel

    from testbed.tiny_model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = BertModel(config)
    model.name_or_path = EMBED_NAME
    mlflow.transformers.save_model(
        transformers_model={"model": model, "tokenizer": tokenizer},
        path=str(path),
        task="llm/v1/embeddings",
        pip_requirements=["transformers"],
    )
    return path


@pytest.fixture(scope="session")
def mlflow_chat_dir(tmp_path_factory, tiny_model_dir) -> Path:
    path = tmp_path_factory.mktemp("mlflow") / "chat"
    return save_llm(tiny_model_dir, path, "llm/v1/chat", model_config=SAVED_CONFIG)


@pytest.fixture(scope="session")
def mlflow_embed_dir(tmp_path_factory) -> Path:
    return save_encoder(tmp_path_factory.mktemp("mlflow") / "embed")
