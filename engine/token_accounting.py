"""How many tokens a request may generate (``docs/token-accounting.md``).

Colocated (``single_node``) requests take min(max_new_tokens, maxIterTimes). Disaggregated
(``pd_separate``): the prefill worker's first token plus the decode worker's tokens; when the
limit is maxIterTimes (max_new_tokens > maxIterTimes) the decode worker generates maxIterTimes
tokens after the first, so the request reports maxIterTimes + 1 — MindIE's rule, kept exactly.
"""

from __future__ import annotations


def output_limit(max_new_tokens: int, max_iter_times: int, disaggregated: bool = False) -> int:
    """Total output tokens (first token included) of a request, colocated or disaggregated: the
    one place a request's limit is worked out (every ``NewRequest`` carries it)."""
    if disaggregated and max_new_tokens > max_iter_times:
        return max_iter_times + 1
    return min(max_new_tokens, max_iter_times)
