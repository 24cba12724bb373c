"""Chained block hashes: the names of cached KV blocks in the Redis index.

Block i's hash covers its own tokens *and every token before it* (it chains the previous
block's hash), as vLLM's and SGLang's KV events do: equal hash means equal whole prefix, so
"how many prefix tokens does instance X hold" is "how many leading hashes X has". Pure Python,
no torch: instances (when caching) and the scheduler (when routing) compute the same names.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = ""


def namespace_of(model: str, cache_salt: str = "") -> str:
    """The prefix-cache namespace of a request: its model, and its tenant's salt when it has one
    (tenants never share cached KV unless they share a salt)."""
    return f"{model}#{cache_salt}" if cache_salt else model


def next_hash(parent: str, tokens: tuple[int, ...] | list[int], namespace: str = "", key: bytes = b"") -> str:
    """Keyed with the cluster's index key (shared/security.py), a hash published to the registry
    cannot be computed from a guessed prompt, so the index cannot be probed for one."""
    h = hashlib.blake2b(digest_size=12, key=key)
    h.update(parent.encode() if parent else b"\0" + namespace.encode())
    h.update(array("q", tokens).tobytes())
    return h.hexdigest()


def block_hashes(
    tokens: list[int], block_size: int, namespace: str = "", limit: int | None = None, key: bytes = b""
) -> list[str]:
    """Hashes of the full blocks of `tokens` (at most `limit` of them): `next_hash` down the chain,
    the tokens packed once and the key taken once (each block's hash copies the keyed state; the
    scheduler hashes every prompt it plans)."""
    n = len(tokens) // block_size
    if limit is not None:
        n = min(n, limit)
    data, step = memoryview(array("q", tokens[: n * block_size]).tobytes()), 8 * block_size
    keyed = hashlib.blake2b(digest_size=12, key=key)
    out, parent = [], b"\0" + namespace.encode()  # the root's, as next_hash seeds it
    for i in range(n):
        h = keyed.copy()
        h.update(parent)
        h.update(data[i * step : (i + 1) * step])
        digest = h.hexdigest()
        out.append(digest)
        parent = digest.encode()
    return out
