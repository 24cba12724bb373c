"""Prefix caches by block: one LRU per instance, one index of who holds what (as Redis does).

Blocks are named by chained hashes (`shared.prefix_hash` for token ids, a Mooncake trace's
hash ids for traces): equal name, equal whole prefix, so an instance's hit is the number of
leading names it holds. Eviction is LRU over blocks, and a lookup touches a prefix from its
last block to its first, so a parent is always at least as recent as its children: LRU evicts
leaves first, as a radix tree would, and never strands a child behind an evicted parent.

`PrefixIndex.leading_hits` answers "how many leading blocks does each instance hold" for all
instances at once by intersecting holder sets block by block, as the scheduler's Redis lookup
does; cost is the blocks walked times the instances still matching.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self.holders: dict[Hashable, set[str]] = {}

    def add(self, block: Hashable, instance: str) -> None:
        self.holders.setdefault(block, set()).add(instance)

    def remove(self, block: Hashable, instance: str) -> None:
        s = self.holders.get(block)
        if s is not None:
            s.discard(instance)
            if not s:
                del self.holders[block]

    def leading_hits(self, blocks: Sequence[Hashable]) -> dict[str, int]:
        """instance -> leading blocks of `blocks` it holds (instances holding none are absent)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for k, block in enumerate(blocks):
            holders = self.holders.get(block)
            now = (set(holders) if alive is None else alive & holders) if holders else set()
            if alive is not None:
                for gone in alive - now:
                    out[gone] = k
            alive = now
            if not alive:
                return out
        for inst in alive or ():
            out[inst] = len(blocks)
        return out


class BlockCache:
    """One instance's cached blocks; `capacity` in blocks (0 = caching off)."""

    def __init__(self, instance: str, capacity: int, index: PrefixIndex) -> None:
        self.instance, self.capacity, self.index = instance, max(capacity, 0), index
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, blocks: Sequence[Hashable]) -> int:
        n = 0
        for block in blocks:
            if block not in self._lru:
                break
            n += 1
        return n

    def touch(self, blocks: Sequence[Hashable]) -> None:
        for block in reversed(blocks):
            if block in self._lru:
                self._lru.move_to_end(block)

    def insert(self, blocks: Sequence[Hashable]) -> None:
        if self.capacity <= 0:
            return
        for block in reversed(blocks[: self.capacity]):
            if block in self._lru:
                self._lru.move_to_end(block)
            else:
                self._lru[block] = None
                self.index.add(block, self.instance)
        self.shrink_to(self.capacity)

    def shrink_to(self, capacity: int) -> None:
        """Evict least recently used blocks until at most `capacity` remain."""
        while len(self._lru) > max(capacity, 0):
            block, _ = self._lru.popitem(last=False)
            self.index.remove(block, self.instance)
            self.evicted += 1
