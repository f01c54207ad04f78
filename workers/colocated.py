"""The colocated worker (``single_node`` deploy mode): one engine computes the prompt and decodes
it, with no KV transfer. Requests are queued with ``generate``; their events go on the worker's
token channel."""

from __future__ import annotations

from workers.contracts import GenerationRequest, Submitted
from workers.runtime import WorkerRuntime


class ColocatedWorker(WorkerRuntime):
    role = "colocated"

    def generate(self, request: GenerationRequest) -> Submitted:
        """Queue ``request`` to its finish (min(max_new_tokens, maxIterTimes))."""
        return self._submit(request)
