"""What a block in a worker's KV tier is worth to the router, against one in its cache: the share
of the block's compute a load from that tier saves, from the worker's own measurements (its
tier's load time per block, its learnt compute time per prompt token), never fixed weights.

A tier that has served no block yet is weighed ``PRIOR_WEIGHT``: worth trying, not worth a
device hit. A tier slower than the compute it saves is worth nothing (a file tier can be).
"""

from __future__ import annotations

from engine.outputs import EngineStats

PRIOR_WEIGHT = 0.5


def tier_weights(stats: EngineStats, block_size: int) -> dict[str, float]:
    """``{tier: weight in [0, 1]}`` for each tier the worker reports."""
    compute_s = stats.prompt_token_seconds * block_size
    weights = {}
    for tier in stats.kv_tiers:
        if tier.hits == 0 or compute_s <= 0:
            weights[tier.name] = PRIOR_WEIGHT
            continue
        load_s = tier.load_seconds / tier.hits
        weights[tier.name] = min(max(1.0 - load_s / compute_s, 0.0), 1.0)
    return weights
