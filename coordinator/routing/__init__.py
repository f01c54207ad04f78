"""How the coordinator picks the workers of each request (docs/architecture.md#routing).

``worker_view``: what it knows of each worker (loads from polls, freshness, the prefix-cache
events it follows); ``cache_view``: what each worker's prefix cache holds, as the worker's events
say plus the dispatches not yet confirmed by them; ``choice``: the pair for one request, a pure
function of those; ``coordinator/router.py`` puts them together."""
