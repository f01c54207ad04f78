"""Shared fixtures: tiny random models built once per session, the bundled model loaded once."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.transfer.payload import KVPayload
from testbed.tiny_model import build_tiny_model
from tests.support.coordinator_servers import servers  # noqa: F401 - a session fixture
from tests.support.mlflow_models import mlflow_chat_dir, mlflow_embed_dir  # noqa: F401 - fixtures

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer Llama with peaked random weights (greedy choices are not near-ties)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), initializer_range=0.3)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir))


def make_engine(
    loaded: LoadedModel,
    block_size: int = 4,
    num_blocks: int = 256,
    prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    **scheduler: int,
) -> LLMEngine:
    cache = CacheConfig(
        block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
    )
    config = EngineConfig(
        model_path=str(loaded.path),
        device="cpu",
        cache=cache,
        kv_cache_dtype=kv_cache_dtype,
        scheduler=SchedulerConfig(**scheduler),
    )
    return LLMEngine(config, loaded)


@pytest.fixture
def tiny_engine(tiny_loaded) -> LLMEngine:
    return make_engine(tiny_loaded)


@pytest.fixture(scope="session")
def bundled_loaded() -> LoadedModel:
    return load_model("bundled")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (it takes several seconds to start)."""
    import ray

    from coordinator.ray_connect import init_ray

    init_ray(num_cpus=8)  # logical CPUs, so that several small clusters fit side by side
    yield ray
    ray.shutdown()


@pytest.fixture
def payload(tiny_loaded) -> KVPayload:
    """The exported KV of a 37-token prompt (tiny model, blocks of 4 tokens), in float32 pages:
    the transports' tests size their pages so (the 16-bit caches: test_kv_cache_dtype.py)."""
    engine = make_engine(tiny_loaded, block_size=4, kv_cache_dtype="float32")
    engine.add_request(
        engine.request(
            "r1", list(range(3, 40)), SamplingParams(max_new_tokens=5, seed=11), prefill_only=True
        )
    )
    while engine.requests["r1"].status != RequestStatus.HELD:
        engine.step()
    payload = engine.export_kv("r1")
    payload.state.max_output_tokens = 5
    return payload


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-host tests run last: their hosts (three raylets, a coordinator) stay up until
    the session ends, and must not weigh on the other tests meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("multihost") is not None)
