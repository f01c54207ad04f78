"""MLflow model directories written by ``mlflow.transformers.save_model`` for ``llm/v1`` tasks.

The directory holds ``MLmodel`` (YAML), the weights in ``model/`` (``model_binary``) and the
tokenizer in ``components/tokenizer/``. ``flavors.python_function.config`` is the saved
``model_config``: generation defaults that a load-time override (only of keys already saved)
and then each request may change. A model saved with ``save_pretrained=False`` holds no weights
(``source_model_revision`` instead of ``model_binary``) and cannot be served offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

MLMODEL = "MLmodel"
TASKS = ("llm/v1/chat", "llm/v1/completions", "llm/v1/embeddings")


@dataclass(frozen=True)
class MlflowModel:
    path: Path
    inference_task: str  # one of TASKS
    name: str  # source_model_name: the name the model is reported under
    weights_dir: Path
    tokenizer_dir: Path
    model_config: dict[str, Any] = field(default_factory=dict)
    mlflow_version: str = ""

    @property
    def generates(self) -> bool:
        return self.inference_task != "llm/v1/embeddings"

    def with_overrides(self, overrides: dict[str, Any]) -> tuple[MlflowModel, list[str]]:
        """Load-time ``model_config`` overrides applied to keys already saved; returns the new
        model and the override keys that were ignored because the saved config lacks them."""
        ignored = sorted(set(overrides) - set(self.model_config))
        merged = {**self.model_config, **{k: v for k, v in overrides.items() if k not in ignored}}
        return replace(self, model_config=merged), ignored


def is_mlflow_dir(model_path: str | Path) -> bool:
    return model_path != "bundled" and (Path(model_path).expanduser() / MLMODEL).is_file()


def read_mlflow_model(model_path: str | Path) -> MlflowModel:
    """Parse and check an MLflow model directory; every problem is a :class:`ModelLoadError`."""
    path = Path(model_path).expanduser()
    mlmodel = _read_mlmodel(path)
    flavors = mlmodel.get("flavors") if isinstance(mlmodel, dict) else None
    flavors = flavors if isinstance(flavors, dict) else {}
    flavor = _transformers_flavor(path, flavors)
    name = str(flavor.get("source_model_name") or path.name)
    config = (flavors.get("python_function") or {}).get("config") or {}
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: python_function.config must be a mapping, got {config!r}")
    weights_dir, tokenizer_dir = _saved_dirs(path, flavor, name)
    version = str(mlmodel.get("mlflow_version", ""))
    task = flavor["inference_task"]
    return MlflowModel(path, task, name, weights_dir, tokenizer_dir, dict(config), version)


def _read_mlmodel(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load((path / MLMODEL).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ModelLoadError(f"cannot read {path / MLMODEL}: {exc}") from exc


def _transformers_flavor(path: Path, flavors: dict) -> dict:
    """The transformers flavor of a model saved with a task pdserve serves."""
    flavor = flavors.get("transformers")
    if not isinstance(flavor, dict):
        raise ModelLoadError(f"{path} is an MLflow model without the transformers flavor")
    task = flavor.get("inference_task")
    if task not in TASKS:
        raise ModelLoadError(
            f"{path} was saved with inference_task {task!r} (task {flavor.get('task')!r}); "
            f"pdserve serves MLflow models saved with task one of {', '.join(TASKS)}"
        )
    return flavor


def _saved_dirs(path: Path, flavor: dict, name: str) -> tuple[Path, Path]:
    """The weights and tokenizer directories the model was saved with."""
    binary = flavor.get("model_binary")
    if not binary:
        revision = flavor.get("source_model_revision")
        raise ModelLoadError(
            f"{path} was saved without weights (save_pretrained=False): it only references "
            f"{name}@{revision}, which cannot be downloaded here; save it again with "
            "save_pretrained=True, or pass the model's own directory to --model"
        )
    weights_dir = path / str(binary)
    if not weights_dir.is_dir():
        raise ModelLoadError(f"{path}: the weights directory {binary}/ is missing")
    tokenizer_dir = path / "components" / "tokenizer"
    if "tokenizer" not in (flavor.get("components") or []) or not tokenizer_dir.is_dir():
        raise ModelLoadError(f"{path}: no tokenizer in components/tokenizer/")
    return weights_dir, tokenizer_dir
