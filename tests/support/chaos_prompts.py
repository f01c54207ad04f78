"""Long prompts for the chaos load on the shipping defaults, each with its greedy text.

The shipping routing prefills a short prompt on the decode worker and hands a long one off
(``local_prefill_tokens``), but only a prompt whose blocks the decode worker does not hold yet:
a repeated long prompt is prefilled there from its cache. So each long prompt of the load is
sent once (numbered, its first block unlike any other's), and its reference text comes from
transformers' greedy ``generate`` on the same weights. Only prompts whose greedy choices are all
at least ``MIN_GAP`` apart (top-two logits; the least gap of the short prompts on the peaked
model) are kept, so a request recomputed in another split, on another engine or after a
migration cannot flip a choice: about one candidate in eight is left out. The texts are
detokenized as the engine streams them (``engine.detokenizer``: an unfinished character at the
end is held back).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from engine.detokenizer import IncrementalDetokenizer
from tests.support.chaos_load import MAX_TOKENS

MIN_GAP = 0.009
BODY = " ".join(str(i) for i in range(45))  # 120-odd tokens: past local_prefill_tokens (96)


def long_prompts(model_dir: Path, count: int) -> dict[str, str]:
    """Greedy texts of up to ``count`` numbered long prompts, those near a tie left out."""
    return greedy_texts(model_dir, [f"{n:04d} {BODY}" for n in range(count)], MIN_GAP)


def greedy_texts(model_dir: Path, prompts: list[str], min_gap: float = 0.0) -> dict[str, str]:
    """Each prompt's greedy text of ``MAX_TOKENS`` tokens (to EOS), if every choice on the way
    won by at least ``min_gap``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_length: dict[int, list[tuple[str, list[int]]]] = defaultdict(list)
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        by_length[len(ids)].append((prompt, ids))
    texts: dict[str, str] = {}
    for group in by_length.values():  # equal lengths: one batch, no padding
        generated = _generate(model, tokenizer, group)
        for (prompt, ids), (tokens, gap) in zip(group, generated, strict=True):
            if gap >= min_gap:
                texts[prompt] = _streamed_text(tokenizer, ids, tokens)
    return texts


def _streamed_text(tokenizer, prompt_ids: list[int], tokens: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    sequence = [*prompt_ids, *tokens]
    for end in range(len(prompt_ids) + 1, len(sequence) + 1):
        detokenizer.append(sequence[:end])
    return detokenizer.text


def _generate(model, tokenizer, group: list[tuple[str, list[int]]]):
    """(greedy tokens, least top-two gap) of each prompt of one length."""
    ids = torch.tensor([ids for _, ids in group])
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top = torch.stack(out.scores, 1).topk(2, dim=-1).values
    gaps = top[..., 0] - top[..., 1]
    for i in range(len(group)):
        tokens = out.sequences[i, ids.shape[1] :].tolist()
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        yield tokens[:length], gaps[i, :length].min().item()
