"""How many tokens a request may generate, in each deploy mode (``docs/token-accounting.md``).

Colocated (``single_node``): min(max_new_tokens, maxIterTimes). Disaggregated (``pd_separate``):
the prefill worker's first token plus the decode worker's tokens; when the limit is maxIterTimes
(max_new_tokens > maxIterTimes) the decode worker generates maxIterTimes tokens after the first,
so the request reports maxIterTimes + 1 — MindIE's rule, kept exactly.
"""

from __future__ import annotations


def single_node_output_limit(max_new_tokens: int, max_iter_times: int) -> int:
    return min(max_new_tokens, max_iter_times)


def pd_output_limit(max_new_tokens: int, max_iter_times: int) -> int:
    """Total output tokens (first token included) of a disaggregated request."""
    if max_new_tokens > max_iter_times:
        return max_iter_times + 1
    return max_new_tokens
