"""Block-granular radix cache on the paged pool: prefixes of earlier requests, shared by refcount.

Each node is one full block of `block_size` tokens under its parent (the block before it), per
namespace (e.g. model or tenant). The cache holds one reference on every block it stores;
a sequence that reuses a prefix takes its own reference (`match`), so a block in use is never
evicted: eviction frees least-recently-used *leaves* whose only reference is the cache's.

Every store and removal is recorded as an `IndexEvent` with the block's chained hash
(`shared.prefix_hash`), for the owner to report to the registry's prefix index.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from shared.messages import IndexEvent
from shared.prefix_hash import ROOT, next_hash
from shared.runtime.kv_pool import BlockAllocator


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    block: int
    hash: str
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class RadixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, hash_key: bytes = b"") -> None:
        self.hash_key = hash_key  # the cluster's index key: the hashes it publishes are keyed
        self.allocator = allocator
        self.block_size = block_size
        self._roots: dict[str, _Node] = {}
        self._clock = itertools.count(1)
        self.num_blocks = 0
        self.events: list[IndexEvent] = []

    def _root(self, namespace: str) -> _Node:
        if namespace not in self._roots:
            self._roots[namespace] = _Node((), -1, ROOT, None)
        return self._roots[namespace]

    def _blocks_of(self, tokens: list[int], limit: int | None) -> list[tuple[int, ...]]:
        bs = self.block_size
        n = len(tokens) // bs if limit is None else min(len(tokens) // bs, limit)
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(n)]

    def match(self, tokens: list[int], namespace: str = "", max_blocks: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of `tokens`; the caller owns a reference on each."""
        node, found, now = self._root(namespace), [], next(self._clock)
        for key in self._blocks_of(tokens, max_blocks):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            found.append(child.block)
            node = child
        self.allocator.incref(found)
        return found

    def insert(self, tokens: list[int], blocks: list[int], namespace: str = "") -> int:
        """Cache the full blocks of `tokens` (KV in `blocks`). Prefixes already cached keep their
        block (stored once); the caller still drops its own references as usual."""
        node, stored, now = self._root(namespace), [], next(self._clock)
        opens = False  # whether the first block stored opens a chain (its parent is the root)
        for key, block in zip(self._blocks_of(tokens, None), blocks):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, block, next_hash(node.hash, key, namespace, self.hash_key), node)
                node.children[key] = child
                self.allocator.incref([block])
                self.num_blocks += 1
                if not stored:
                    opens = node.parent is None
                stored.append(child.hash)
            child.last_used = now
            node = child
        if stored:
            self.events += _split_firsts("stored", stored[:1] if opens else [], stored[1:] if opens else stored)
        return len(stored)

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks, least recently used leaves first. Each round scans the
        tree (fine for the thousands of blocks a pool here holds; a heap would scale further)."""
        freed: list[_Node] = []
        while len(freed) < num_blocks:
            leaves = [n for n in self._nodes() if not n.children and self.allocator.refcount(n.block) == 1]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_used)
            for leaf in leaves[: num_blocks - len(freed)]:
                del leaf.parent.children[leaf.key]
                self.allocator.free([leaf.block])
                freed.append(leaf)
        self.num_blocks -= len(freed)
        if freed:
            firsts = [n.hash for n in freed if n.parent.parent is None]  # under a root
            self.events += _split_firsts("removed", firsts, [n.hash for n in freed if n.parent.parent is not None])
        return len(freed)

    def clear(self) -> None:
        """Drop every cached block (those in use stay alive through their users' references)."""
        for node in self._nodes():
            self.allocator.free([node.block])
        self._roots.clear()
        self.num_blocks = 0
        self.events.append(IndexEvent("cleared"))

    def all_events(self) -> list[IndexEvent]:
        """The whole cache as "stored" events, after a "cleared" (a resync of the index)."""
        nodes = list(self._nodes())
        firsts = [n.hash for n in nodes if n.parent.parent is None]
        return [
            IndexEvent("cleared"),
            *_split_firsts("stored", firsts, [n.hash for n in nodes if n.parent.parent is not None]),
        ]

    def drain_events(self) -> list[IndexEvent]:
        events, self.events = self.events, []
        return events

    def _nodes(self):
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _split_firsts(kind: str, firsts: list[str], rest: list[str]) -> list[IndexEvent]:
    """One event for the chains' first blocks (marked `first`), one for the rest; none empty."""
    return ([IndexEvent(kind, firsts, first=True)] if firsts else []) + ([IndexEvent(kind, rest)] if rest else [])
