"""KV tiers under a worker's paged cache (``engine/kv_tiers/tiers.py``): a node-shared one in
shared memory and one on disk, fed by the prefix cache's evictions and read at admission
(``engine/kv_tiers/engine_tiers.py``: an engine's)."""
