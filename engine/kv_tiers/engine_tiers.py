"""An engine's KV tiers (``engine/kv_tiers/tiers.py``) over its paged cache, as its cache
configuration asks, keyed by its KV layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.config import CacheConfig
from engine.kv_cache import KVCache
from engine.kv_tiers.tiers import KvTiers, TierSettings
from engine.transfer.payload import KVLayout


def layout_key(layout: KVLayout) -> str:
    """What a tier's block must have been written under to be read: every field of the
    engine's KV layout (model fingerprint, page layout, dtype, block size, shape)."""
    return "|".join(str(value) for value in dataclasses.astuple(layout))


def tiers_for(cache: CacheConfig, layout: KVLayout, kv_cache: KVCache) -> KvTiers | None:
    """The tiers ``cache`` asks for over ``kv_cache``'s pages; None when it asks for none."""
    settings = TierSettings(
        host_bytes=cache.host_tier_mb << 20,
        host_path=Path(cache.host_tier_path),
        disk_bytes=cache.disk_tier_mb << 20,
        disk_path=Path(cache.disk_tier_path) if cache.disk_tier_path else None,
        disk_admit_after=cache.disk_admit_after,
    )
    if not settings.enabled:
        return None
    shape = kv_cache.data.shape
    page_shape = (shape[0], shape[1], 1, *shape[3:])
    return KvTiers(
        settings, layout_key(layout), page_shape, kv_cache.data.dtype,
        kv_cache.export_blocks, kv_cache.import_blocks, pinned=kv_cache.data.is_cuda,
    )  # fmt: skip
