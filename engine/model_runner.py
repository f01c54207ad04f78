"""Builds a :class:`ForwardBatch` from the scheduler's output and runs the model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.forward_batch import ForwardBatch, PrefillSeq
from engine.model.llama import LlamaModel
from engine.request import Request
from engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_layers: list[torch.Tensor],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.device = device

    def run(
        self,
        scheduled: SchedulerOutput,
        before_forward: Callable[[list[Request]], None] | None = None,
    ) -> tuple[torch.Tensor, list[Request]]:
        """Compute the step; return logits for the requests that reach their last token.
        ``before_forward`` gets those requests once the batch is laid out, before the forward
        runs (what overlaps it: their grammars' masks)."""
        batch, samplers = self.prepare(scheduled)
        if before_forward is not None:
            before_forward(samplers)
        return self.forward(batch), samplers

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of ``batch``'s sampling rows."""
        return self.model.forward(batch, self.kv_layers)

    def prepare(self, scheduled: SchedulerOutput) -> tuple[ForwardBatch, list[Request]]:
        """The step's rows, and the request of each logits row: a decode row, then one row per
        token of its draft (``Request.draft_token_ids``), each attending to the rows before it;
        then the prompt chunks."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Request] = []
        decode_rows: list[tuple[Request, int]] = []  # (request, context length)
        for request in scheduled.decodes:
            start = request.num_computed_tokens
            tokens = [request.token_ids[start], *request.draft_token_ids]
            for position, token in enumerate(tokens, start):
                logits_rows.append(len(input_ids))
                input_ids.append(token)
                positions.append(position)
                slots.append(request.block_ids[position // bs] * bs + position % bs)
                decode_rows.append((request, position + 1))
            samplers.extend([request] * len(tokens))
        # a chunk may be a single token (the step's last unit of prefill budget) and is still
        # attended as a chunk, not as a decode
        prefill_seqs: list[PrefillSeq] = []
        for request, num_tokens in scheduled.prefills:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            table = torch.tensor(request.block_ids[: -(-end // bs)], device=self.device)
            prefill_seqs.append(PrefillSeq(len(input_ids), num_tokens, end, table))
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(request.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if end == request.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                samplers.append(request)
        context_lens = [length for _, length in decode_rows]
        max_blocks = max((-(-n // bs) for n in context_lens), default=0)
        tables = [
            r.block_ids[:max_blocks] + [0] * (max_blocks - len(r.block_ids)) for r, _ in decode_rows
        ]
        tensor = self._tensor
        batch = ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            num_decode_tokens=len(decode_rows),
            decode_block_tables=tensor(tables).view(len(decode_rows), max_blocks),
            decode_context_lens=tensor(context_lens),
            decode_max_context_len=max(context_lens, default=0),
            prefill_seqs=prefill_seqs,
            logits_indices=tensor(logits_rows),
        )
        return batch, samplers

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
