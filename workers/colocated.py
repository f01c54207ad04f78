"""The colocated worker (``single_node`` deploy mode): one engine computes the prompt and decodes
it, with no KV transfer. Requests are queued with ``generate`` and streamed back."""

from __future__ import annotations

from collections.abc import Iterator

from engine.outputs import TokenEvent
from workers.contracts import GenerationRequest
from workers.runtime import WorkerRuntime


class ColocatedWorker(WorkerRuntime):
    role = "colocated"

    def generate(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        """Token events of ``request`` up to its finish (min(max_new_tokens, maxIterTimes))."""
        yield from self._run(request)
