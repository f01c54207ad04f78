"""The colocated worker (``single_node`` deploy mode): one engine computes the prompt and decodes
it, with no KV transfer. Requests are queued with ``generate`` and streamed back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.outputs import TokenEvent
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.worker_runtime import WorkerRuntime


class ColocatedWorker(WorkerRuntime):
    role = "colocated"

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: dict[str, Any],
        priority: int = 5,
    ) -> Iterator[TokenEvent]:
        q = self._open(request_id)
        sampling = SamplingParams.from_dict(params)
        try:
            self.loop.call(
                lambda e: e.add_request(request_id, prompt_token_ids, sampling, priority)
            ).result()
        except Exception as exc:
            self._end(request_id, FinishReason.ERROR, str(exc))
        yield from self._drain(request_id, q)
