"""Model loading: clear errors for a missing path, a corrupt file or an unsupported architecture."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.config import EngineConfig
from engine.errors import ConfigError, ModelLoadError
from engine.model.loader import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt2"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(str(model))


def test_corrupt_config(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir, tmp_path / "m")
    (model / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt config.json"):
        load_model(str(model))


def test_corrupt_weights(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir, tmp_path / "m")
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="corrupt weight file"):
        load_model(str(model))


def test_missing_weights(tiny_model_dir, tmp_path):
    model = _copy(tiny_model_dir, tmp_path / "m")
    next(model.glob("*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(str(model))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(str(bad))


def test_a_bad_device_fails_on_use_and_a_bad_dtype_at_construction():
    config = EngineConfig(device="tpu")
    with pytest.raises(ConfigError, match="device"):
        _ = config.torch_dtype
    with pytest.raises(ConfigError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(dtype="int8")


def test_tokenizer_and_chat_template_come_from_transformers(tiny_loaded):
    text = tiny_loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
