"""The bundled all-MiniLM-L6-v2 against a plain transformers + mean-pooling reference."""

from __future__ import annotations

import torch

from engine.embedding_model import EmbeddingModel
from engine.model.model_files import bundled_embedding_dir
from workers.embedding import EmbeddingWorker


def test_bundled_embeddings_match_a_direct_reference():
    from transformers import AutoModel, AutoTokenizer

    texts = ["A paged KV cache stores keys and values.", "你好，世界", "short"]
    ours = EmbeddingModel().embed(texts)
    path = bundled_embedding_dir()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    with torch.no_grad():
        for i, text in enumerate(texts):  # one at a time: no padding in the reference
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            ref = torch.nn.functional.normalize(hidden.mean(0), dim=-1)
            torch.testing.assert_close(ours[i], ref, atol=1e-5, rtol=1e-4)
    assert ours.shape == (3, 384)


def test_worker_batches_concurrent_calls():
    import concurrent.futures as futures

    worker = EmbeddingWorker()
    identity = worker.ready()  # typed; ``pdserve workers`` prints it as the dict it was
    assert list(identity.describe()) == ["role", "pid", "model", "dimensions"]
    assert identity.role == "embedding" and identity.dimensions == 384
    with futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: worker.embed([f"text {i}", f"more {i}"]), range(16)))
    assert all(r["embeddings"].shape == (2, 384) for r in results)
    assert worker.num_batches < 16  # calls were merged
    single = worker.embed(["text 3"])["embeddings"][0]
    torch.testing.assert_close(results[3]["embeddings"][0], single, atol=1e-5, rtol=1e-4)
