"""Reading MLflow model directories written by the real mlflow.transformers.save_model."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from coordinator.config.loader import defaults
from coordinator.served_model import served_models
from engine.embedding_model import EmbeddingModel
from engine.errors import ModelLoadError
from engine.model.loader import load_model
from engine.model.mlflow_model import read_mlflow_model
from tests.conftest import make_engine
from tests.support.mlflow_models import CHAT_NAME, EMBED_NAME, SAVED_CONFIG, save_llm


def _greedy(loaded, prompt_ids):
    from engine.sampling_params import SamplingParams

    engine = make_engine(loaded)
    return engine.generate([prompt_ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]


def test_chat_directory_is_read(mlflow_chat_dir):
    model = read_mlflow_model(mlflow_chat_dir)
    assert model.inference_task == "llm/v1/chat" and model.generates
    assert model.name == CHAT_NAME
    assert model.model_config == SAVED_CONFIG
    assert (model.weights_dir / "config.json").is_file()
    assert (model.tokenizer_dir / "tokenizer.json").is_file()


def test_served_weights_and_tokenizer_are_the_saved_ones(mlflow_chat_dir, tiny_loaded):
    loaded = load_model(str(mlflow_chat_dir))
    assert loaded.name == CHAT_NAME
    ids = tiny_loaded.tokenizer.encode("The quick brown fox")
    assert loaded.tokenizer.encode("The quick brown fox") == ids
    assert _greedy(loaded, ids) == _greedy(tiny_loaded, ids)


def test_load_time_overrides_touch_only_saved_keys(mlflow_chat_dir):
    model, ignored = read_mlflow_model(mlflow_chat_dir).with_overrides(
        {"max_new_tokens": 3, "top_k": 5}
    )
    assert model.model_config == {**SAVED_CONFIG, "max_new_tokens": 3}
    assert ignored == ["top_k"]


def test_model_saved_without_weights_is_a_clear_error(mlflow_chat_dir, tmp_path):
    path = shutil.copytree(mlflow_chat_dir, tmp_path / "reference-only")
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    flavor = mlmodel["flavors"]["transformers"]
    del flavor["model_binary"]
    flavor["source_model_revision"] = "0123abcd"
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    shutil.rmtree(path / "model")
    with pytest.raises(ModelLoadError, match="saved without weights.*0123abcd.*save_pretrained"):
        load_model(str(path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["flavors"].pop("transformers"), "without the transformers flavor"),
        (
            lambda m: m["flavors"]["transformers"].update(inference_task=None),
            "pdserve serves MLflow models saved with task one of llm/v1/chat",
        ),
    ],
)
def test_unservable_mlmodel_is_named(mlflow_chat_dir, tmp_path, edit, message):
    path = shutil.copytree(mlflow_chat_dir, tmp_path / "m", ignore=shutil.ignore_patterns("model"))
    mlmodel = yaml.safe_load((path / "MLmodel").read_text())
    edit(mlmodel)
    (path / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    with pytest.raises(ModelLoadError, match=message):
        read_mlflow_model(path)


def test_embeddings_directory_makes_an_embeddings_only_server(mlflow_embed_dir):
    config = defaults().with_overrides({"backend_config.model_path": str(mlflow_embed_dir)})
    served = served_models(config)
    assert served.generation is None and served.task == "llm/v1/embeddings"
    assert served.embedding_path == str(mlflow_embed_dir)
    assert (served.name, served.embedding_dimensions) == (EMBED_NAME, 32)
    with pytest.raises(ModelLoadError, match="it embeds, it cannot generate"):
        load_model(str(mlflow_embed_dir))


def test_embeddings_match_transformers_mean_pooling(mlflow_embed_dir):
    from transformers import AutoModel, AutoTokenizer

    texts = ["hello world", "a paged KV cache stores keys"]
    ours = EmbeddingModel(str(mlflow_embed_dir)).embed(texts)
    tokenizer = AutoTokenizer.from_pretrained(mlflow_embed_dir / "components" / "tokenizer")
    model = AutoModel.from_pretrained(mlflow_embed_dir / "model").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_completions_model_saved_and_read(tiny_model_dir, tmp_path):
    path = save_llm(tiny_model_dir, tmp_path / "completions", "llm/v1/completions")
    model = read_mlflow_model(path)
    assert model.inference_task == "llm/v1/completions" and model.model_config == {}
