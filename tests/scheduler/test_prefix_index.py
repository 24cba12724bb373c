"""The prefix index's lookup (shared/registry.py), against a real redis-server: block hashes are
chained, so an instance holds a prefix only up to its first missing block; a block it holds
after a gap is no part of that prefix and must not count."""

from __future__ import annotations

from shared.messages import IndexEvent
from shared.registry import Registry

HASHES = ["b0", "b1", "b2", "b3"]  # the prompt's chained block hashes, in order


async def holds(registry: Registry, instance_id: str, hashes: list[str]) -> None:
    await registry.apply_kv_events(instance_id, [IndexEvent("cleared"), IndexEvent("stored", hashes)])


async def test_a_gap_in_the_chain_stops_the_count(registry):
    await holds(registry, "gap", ["b0", "b2", "b3"])  # block 1 missing: only block 0 is a prefix
    await holds(registry, "all", HASHES)
    await holds(registry, "tail", ["b1", "b2", "b3"])  # no block 0: no prefix at all
    await holds(registry, "head", ["b0", "b1"])
    assert await registry.prefix_blocks(["gap", "all", "tail", "head", "unknown"], HASHES) == {
        "gap": 1,
        "all": 4,
        "tail": 0,
        "head": 2,
        "unknown": 0,
    }


async def test_the_count_follows_removals(registry):
    await holds(registry, "md-0", HASHES)
    await registry.apply_kv_events("md-0", [IndexEvent("removed", ["b1"])])  # evicted from the middle
    assert await registry.prefix_blocks(["md-0"], HASHES) == {"md-0": 1}
    await registry.apply_kv_events("md-0", [IndexEvent("stored", ["b1"])])
    assert await registry.prefix_blocks(["md-0"], HASHES) == {"md-0": 4}
    assert await registry.prefix_blocks(["md-0"], []) == {"md-0": 0}
