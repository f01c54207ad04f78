"""How many prompt tokens a step may carry, so that running streams keep their pace.

A step computes every running request's next token plus some prompt tokens (chunked prefill). A
big chunk stalls every stream for its whole length: a 1,000-token prompt on one CPU core holds
all running requests for seconds. With ``stepTargetMs`` set, a step that decodes running
requests carries only as many prompt tokens as fit in that time; a step with nothing to decode
may carry ``maxPrefillTokens``, as before.

The fit comes from the engine's own steps, one cost model per engine, updated after every step
by exponential averaging: a step of ``d`` decode rows and ``p`` prompt tokens takes about
``decode_s + p * token_s`` seconds, where ``decode_s`` is learnt from steps without prompt
tokens and ``token_s`` from the rest (their time beyond ``decode_s``, per prompt token). At least
``MIN_CHUNK_TOKENS`` go in each step, so a prompt always progresses.
"""

from __future__ import annotations

SMOOTHING = 0.2  # weight of the newest step in the averages
MIN_CHUNK_TOKENS = 16
PRIOR_DECODE_S = 0.02  # before any step was seen: a decode step of a small model on a CPU core
PRIOR_TOKEN_S = 0.003  # and a prompt token
MIN_TOKEN_S = 1e-6  # a floor for the learnt cost of a prompt token


class StepBudget:
    def __init__(self, target_ms: int, max_tokens: int) -> None:
        """``target_ms``: the target duration of a step that decodes (0: no target);
        ``max_tokens``: ``maxPrefillTokens``."""
        self.target_s = target_ms / 1000
        self.max_tokens = max_tokens
        self.decode_s = PRIOR_DECODE_S
        self.token_s = PRIOR_TOKEN_S  # the learnt cost of a prompt token

    def tokens(self, num_decodes: int) -> int:
        """Prompt tokens the next step may carry beside ``num_decodes`` decode rows."""
        if not (self.target_s and num_decodes):
            return self.max_tokens
        fit = int((self.target_s - self.decode_s) / self.token_s)
        return max(MIN_CHUNK_TOKENS, min(fit, self.max_tokens))

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        """Learn from a step that took ``seconds``."""
        if num_prompt_tokens == 0:
            if num_decodes:
                self.decode_s += SMOOTHING * (seconds - self.decode_s)
            return
        base = self.decode_s if num_decodes else 0.0
        per_token = max(seconds - base, 0.0) / num_prompt_tokens
        learnt = self.token_s + SMOOTHING * (per_token - self.token_s)
        self.token_s = max(learnt, MIN_TOKEN_S)
