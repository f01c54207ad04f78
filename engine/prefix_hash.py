"""Block hashes for prefix caching: a full block of KV is named by a hash chained from its
parent block's hash and its own token ids, so equal hashes mean equal prefixes (up to a
collision, which the block manager rules out by comparing the tokens too).

The chain starts at a *root*: the engine's model fingerprint (KV of another model is never
reused), plus any later input that changes the KV (an adapter, an image), and the request's
*tenant* (:func:`tenant_root`): requests of different tenants never share a block, so a cache hit
(and ``cached_tokens``) can never tell one tenant what another sent. The coordinator's routing
index uses the same functions with its own root.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_HASH_BYTES = 16


def tenant_root(root: bytes, tenant: str) -> bytes:
    """The chain's root for ``tenant``'s requests: ``root`` itself for no tenant ("")."""
    if not tenant:
        return root
    data = root + b"\x00tenant\x00" + tenant.encode()
    return hashlib.blake2b(data, digest_size=BLOCK_HASH_BYTES).digest()


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block holding ``tokens`` whose preceding block hashes to ``parent``."""
    data = parent + array("q", tokens).tobytes()
    return hashlib.blake2b(data, digest_size=BLOCK_HASH_BYTES).digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, root: bytes, num_tokens: int
) -> list[bytes]:
    """Append to ``hashes`` (the hashes of the leading blocks of ``token_ids``) those of the
    next full blocks within the first ``num_tokens`` tokens; returns ``hashes``."""
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(chain_hash(parent, token_ids[start : start + block_size]))
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes = b"") -> list[bytes]:
    """The hashes of every full block of ``token_ids``."""
    return extend_block_hashes([], token_ids, block_size, root, len(token_ids))
