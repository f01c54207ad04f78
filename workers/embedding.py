"""The embedding worker: a Ray actor that batches concurrent ``embed`` calls into one forward.

Callers block on their own future; a batching thread takes everything queued (up to
``max_batch_texts``), runs the encoder once, and hands each caller its rows.
"""

from __future__ import annotations

import functools
import os
import queue
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.openmp import start_building
from workers.contracts import EmbedderIdentity

if TYPE_CHECKING:
    from engine.embedding_model import EmbeddingModel


class EmbeddingWorker:
    role = "embedding"

    def __init__(
        self, model_path: str = "bundled", num_threads: int = 1, max_batch_texts: int = 256
    ) -> None:
        import torch  # the encoder's modules load here: a coordinator names this class only

        from engine.embedding_model import EmbeddingModel

        torch.set_num_threads(num_threads)
        self.max_batch_texts = max_batch_texts
        self._queue: queue.Queue[tuple[list[str], Future]] = queue.Queue()
        self.num_batches = 0
        # loaded on the thread that embeds: one OpenMP team in the process (engine/openmp.py)
        load = functools.partial(EmbeddingModel, model_path)
        self.model, _ = start_building(load, self._run, "embedding-batcher")

    def ready(self) -> EmbedderIdentity:
        return EmbedderIdentity(self.role, os.getpid(), self.model.name, self.model.dimensions)

    def embed(self, texts: list[str]) -> dict[str, Any]:
        """``{"embeddings": float32 [n, d] tensor, "tokens": [n]}`` for the texts, in order."""
        future: Future = Future()
        self._queue.put((texts, future))
        return future.result()

    def _run(self, model: EmbeddingModel) -> None:
        self.model = model
        while True:
            work = [self._queue.get()]
            size = len(work[0][0])
            while size < self.max_batch_texts:
                try:
                    work.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                size += len(work[-1][0])
            self._serve(work)

    def _serve(self, work: list[tuple[list[str], Future]]) -> None:
        texts = [text for chunk, _ in work for text in chunk]
        try:
            vectors = self.model.embed(texts)
            tokens = self.model.count_tokens(texts)
        except Exception as exc:
            for _, future in work:
                future.set_exception(exc)
            return
        self.num_batches += 1
        start = 0
        for chunk, future in work:
            end = start + len(chunk)
            future.set_result(
                {"embeddings": vectors[start:end].clone(), "tokens": tokens[start:end]}
            )
            start = end
