"""Prefill and decode workers in-process over a tiny model: what the worker tests share."""

from __future__ import annotations

import time
from typing import Any

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, KVTransferConfig
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker
from tests.support.channel_reader import OWNER
from workers.contracts import GenerationRequest


def _config(model_dir, num_blocks: int = 64) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=num_blocks)
    return EngineConfig(model_path=str(model_dir), device="cpu", cache=cache)


# the workers' hand-off settings (transport, shared_memory), and the path the pages must take
HANDOFFS = {
    "zmq_shm": (("zmq", True), "shared_memory"),
    "zmq_frames": (("zmq", False), "frames"),
    "grpc": (("grpc", True), "chunks"),
    "inprocess": (("inprocess", True), "direct"),
}


def _decode_worker(model_dir, num_blocks: int = 4) -> DecodeWorker:
    return DecodeWorker(_config(model_dir, num_blocks), KVTransferConfig("inprocess"))


def _stop(*workers: Any) -> None:
    """Stop each worker's engine thread and close its token channel and KV plane's end."""
    for worker in workers:
        worker.close()
        if isinstance(worker, DecodeWorker):
            worker.receiver.close()
        elif isinstance(worker, PrefillWorker):
            worker.sender.close()


def _used(worker) -> int:
    return worker.load().stats.num_used_blocks


def _assert_freed(worker, deadline_s: float = 5.0) -> None:
    """All the worker's blocks come free within ``deadline_s``: prefill posts a hand-off's result
    first and frees the blocks right after, on its engine thread."""
    deadline = time.monotonic() + deadline_s
    while _used(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _used(worker) == 0


def _request(request_id: str, num_prompt_tokens: int = 5, priority: int = 5) -> GenerationRequest:
    """A request of the coordinator a ``ChannelReader`` attaches as by default."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = range(5, 5 + num_prompt_tokens)
    return GenerationRequest(request_id, prompt, params, priority, owner=OWNER)
