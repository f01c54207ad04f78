"""What the coordinator serves, read from ``backend_config`` before any actor starts.

``model_path`` names the generating model (bundled, a HF directory, a ``.gguf`` file, or an
MLflow ``llm/v1/chat`` / ``llm/v1/completions`` directory) — or an MLflow ``llm/v1/embeddings``
directory, which makes an embeddings-only server: no prefill/decode actors, and the encoder from
that directory replaces ``embedding_model_path``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from coordinator.cluster_config import ActorResources, ClusterConfig
from coordinator.config import CoordinatorConfig
from coordinator.content_safety import ContentFilter
from coordinator.model_info import ModelInfo
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.embedding_model import embedding_model_dirs
from engine.model.loader import load_hf_config, load_tokenizer, model_name, resolve_model_dir
from engine.model.loader import tokenizer_dir as model_tokenizer_dir
from engine.model.mlflow_model import MlflowModel, is_mlflow_dir, read_mlflow_model

log = logging.getLogger(__name__)


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
    b = config["backend_config"]
    hf = load_hf_config(resolve_model_dir(b["model_path"]))
    limit = min(b["maxInputTokenLen"], b["maxSeqLen"] - 1, hf.max_position_embeddings)
    return ModelInfo(
        model_name(b["model_path"]),
        load_tokenizer(model_tokenizer_dir(b["model_path"])),
        hf.max_position_embeddings,
        hf.vocab_size,
        limit,
        b["fullTextEnabled"],
        allowed_media_dirs=b["allowed_media_dirs"],
        content_filter=ContentFilter.from_config(config["content_safety"]),
    )


def _embedding_info(path: str) -> tuple[str, int]:
    """Name and dimensions of the embedding model, read from its config.json."""
    model_dir, _, name = embedding_model_dirs(path)
    return name, json.loads((model_dir / "config.json").read_text())["hidden_size"]


def cluster_config(config: CoordinatorConfig, served: ServedModels) -> ClusterConfig:
    b = config["backend_config"]
    engine = EngineConfig(
        model_path=b["model_path"],
        device=b["device"],
        dtype=b["dtype"],
        weight_dtype=b["weight_dtype"],
        cache=CacheConfig(
            block_size=b["cacheBlockSize"],
            memory_mb=b["kvCacheMemoryMB"],
            enable_prefix_caching=b["enablePrefixCaching"],
        ),
        scheduler=SchedulerConfig(
            max_seq_len=b["maxSeqLen"],
            max_input_token_len=b["maxInputTokenLen"],
            max_iter_times=b["maxIterTimes"],
            max_batch_size=b["maxBatchSize"],
            max_prefill_tokens=b["maxPrefillTokens"],
            max_prefill_batch_size=b["maxPrefillBatchSize"],
            step_target_ms=config.step_target_ms,
        ),
    )
    base = ClusterConfig()
    return ClusterConfig(
        deploy_mode=config["digs_scheduler_config"]["deploy_mode"],
        kv_host=b["kv_host"],
        prefill_resources=ActorResources.from_dict(
            "backend_config.prefill_resources", b["prefill_resources"], base.prefill_resources
        ),
        decode_resources=ActorResources.from_dict(
            "backend_config.decode_resources", b["decode_resources"], base.decode_resources
        ),
        colocated_resources=ActorResources.from_dict(
            "backend_config.colocated_resources",
            b["colocated_resources"],
            base.colocated_resources,
        ),
        num_prefill=b["num_prefill_instances"],
        num_decode=b["num_decode_instances"],
        num_colocated=b["num_colocated_instances"],
        kv_transport=b["kv_transport"],
        kv_shared_memory=b["kv_shared_memory"],
        share_idle_cores=b["share_idle_cores"],
        decode_yield_ms=b["decode_yield_ms"],
        decode_yield_percent=b["decode_yield_percent"],
        decode_yield_tpot_ms=b["decode_yield_tpot_ms"],
        kv_encryption=b["kv_encryption"],
        transfer_timeout_s=float(b["kv_transfer_timeout_s"]),
        reservation_timeout_s=float(b["kv_reservation_timeout_s"]),
        engine=engine,
        generation=served.generation is not None,
        embedding_model_path=served.embedding_path,
        reservation_wait_s=float(config["exception_config"]["schedule_timeout"] or 3600),
    )
