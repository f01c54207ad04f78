"""What the coordinator serves, read from ``backend_config`` before any actor starts.

``model_path`` names the generating model (bundled, a HF directory, a ``.gguf`` file, or an
MLflow ``llm/v1/chat`` / ``llm/v1/completions`` directory) — or an MLflow ``llm/v1/embeddings``
directory, which makes an embeddings-only server: no prefill/decode actors, and the encoder from
that directory replaces ``embedding_model_path``.

The dataclasses the configuration feeds are built here from the keys' own ``feeds``
(``coordinator/config/schema.py``): the cluster's, the router's and the doors' ``ModelInfo``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from coordinator.config.cluster import ClusterConfig
from coordinator.config.keys import build
from coordinator.config.loader import CoordinatorConfig
from coordinator.content_safety import ContentFilter
from coordinator.model_info import ModelInfo
from coordinator.routing.config import RoutingConfig
from engine.config import EngineConfig
from engine.model.mlflow_model import MlflowModel, is_mlflow_dir, read_mlflow_model
from engine.model.model_files import (
    embedding_model_dirs,
    load_tokenizer,
    model_limits,
    model_name,
    resolve_model_dir,
)
from engine.model.model_files import tokenizer_dir as model_tokenizer_dir

log = logging.getLogger(__name__)
NO_TIMEOUT_RESERVATION_WAIT_S = 3600.0  # schedule_timeout 0 (off): a hand-off waits an hour


@dataclass(frozen=True)
class ServedModels:
    generation: ModelInfo | None  # None: an embeddings-only server
    embedding_path: str | None  # None: no embedding worker
    embedding_name: str = ""
    embedding_dimensions: int = 0
    mlflow: MlflowModel | None = None

    @property
    def task(self) -> str:
        """The ``llm/v1`` task ``/invocations`` serves."""
        return self.mlflow.inference_task if self.mlflow else "llm/v1/chat"

    @property
    def name(self) -> str:
        return self.generation.name if self.generation else self.embedding_name


def served_models(config: CoordinatorConfig) -> ServedModels:
    b = config["backend_config"]
    mlflow = _mlflow_model(b["model_path"], b["model_config"])
    generates = mlflow is None or mlflow.generates
    embedding_path = (b["embedding_model_path"] if generates else b["model_path"]) or None
    name, dimensions = _embedding_info(embedding_path) if embedding_path else ("", 0)
    return ServedModels(
        _generation_info(config) if generates else None, embedding_path, name, dimensions, mlflow
    )


def _mlflow_model(model_path: str, overrides: dict) -> MlflowModel | None:
    if not is_mlflow_dir(model_path):
        if overrides:
            log.warning("backend_config.model_config applies to MLflow models only: ignored")
        return None
    mlflow, ignored = read_mlflow_model(model_path).with_overrides(overrides)
    if ignored:
        log.warning(
            "model_config overrides %s ignored: the saved model_config has no such keys", ignored
        )
    return mlflow


def _generation_info(config: CoordinatorConfig) -> ModelInfo:
    path = config["backend_config"]["model_path"]
    limits = model_limits(resolve_model_dir(path))
    scheduler = build(ClusterConfig, config.fed(ClusterConfig)).engine.scheduler
    return ModelInfo(
        model_name(path),
        load_tokenizer(model_tokenizer_dir(path)),
        limits.max_position_embeddings,
        limits.vocab_size,
        scheduler.max_prompt_tokens(limits.max_position_embeddings),
        content_filter=ContentFilter.from_config(config["content_safety"]),
        **config.fed(ModelInfo),
    )


def _embedding_info(path: str) -> tuple[str, int]:
    """Name and dimensions of the embedding model, read from its config.json."""
    model_dir, _, name = embedding_model_dirs(path)
    return name, json.loads((model_dir / "config.json").read_text())["hidden_size"]


def cluster_config(config: CoordinatorConfig, served: ServedModels) -> ClusterConfig:
    """The cluster: every key that feeds a ClusterConfig field, and what ``served`` needs."""
    timeout_s = config["exception_config"]["schedule_timeout"]
    return build(
        ClusterConfig,
        {
            **config.fed(ClusterConfig),
            "reservation_wait_s": float(timeout_s or NO_TIMEOUT_RESERVATION_WAIT_S),
            "generation": served.generation is not None,
            "embedding_model_path": served.embedding_path,
        },
    )


def routing_config(config: CoordinatorConfig, engine: EngineConfig) -> RoutingConfig:
    """The router's settings; without prefix caching in the engines, pairs by load only."""
    routing, cache = config.fed(RoutingConfig), engine.cache
    prefix_routing = routing.pop("prefix_routing") and cache.enable_prefix_caching
    return RoutingConfig(prefix_routing=prefix_routing, block_size=cache.block_size, **routing)
