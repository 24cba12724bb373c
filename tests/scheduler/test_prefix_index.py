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
        "head": 2,
    }  # "tail" and "unknown" hold no prefix: absent, not 0


async def test_the_count_follows_removals(registry):
    await holds(registry, "md-0", HASHES)
    await registry.apply_kv_events("md-0", [IndexEvent("removed", ["b1"])])  # evicted from the middle
    assert await registry.prefix_blocks(["md-0"], HASHES) == {"md-0": 1}
    await registry.apply_kv_events("md-0", [IndexEvent("stored", ["b1"])])
    assert await registry.prefix_blocks(["md-0"], HASHES) == {"md-0": 4}
    assert await registry.prefix_blocks(["md-0"], []) == {}
    assert await registry.prefix_blocks([], HASHES) == {}


async def test_a_long_prefix_is_counted_across_lookup_chunks(registry):
    """A prompt of 600 blocks: one that holds them all, one with a hole at block 300 (past the
    first chunk of 256 the lookup asks for at once), one holding only the first."""
    chain = [f"c{i}" for i in range(600)]
    await holds(registry, "all", chain)
    await holds(registry, "hole", chain[:300] + chain[301:])
    await holds(registry, "first", chain[:1])
    counts = await registry.prefix_blocks(["all", "hole", "first"], chain)
    assert counts == {"all": 600, "hole": 300, "first": 1}


async def test_a_run_ending_at_each_chunk_edge_is_counted_exactly(registry):
    """The rest of a run is asked for in chunks that double (8, 16, 32, ... 256 blocks after the
    first): a run that ends just before, at and just after each edge counts to its last block."""
    chain = [f"e{i}" for i in range(800)]
    edges = [1, 9, 25, 57, 121, 249, 505]  # where each chunk ends, counting the first block
    ends = sorted({n + d for n in edges for d in (-1, 0, 1)} | {800})
    for n in ends:
        await holds(registry, f"run-{n}", chain[:n])
    counts = await registry.prefix_blocks([f"run-{n}" for n in ends], chain)
    assert counts == {f"run-{n}": n for n in ends if n}  # run-0 holds nothing


async def test_the_alive_list_drops_only_rows_that_expired(registry):
    """`alive()` reads the set of ids, not every key; an id whose row expired leaves the set,
    one written again meanwhile stays."""
    from shared.messages import InstanceInfo
    from shared.registry import INSTANCES

    await registry.heartbeat(InstanceInfo("md-0", "md", "B"))
    await registry.heartbeat(InstanceInfo("md-1", "md", "B"))
    await registry.r.delete("pdd:instance:md-1")  # its heartbeat expired
    assert [i.id for i in await registry.alive()] == ["md-0"]
    assert await registry.r.smembers(INSTANCES) == {"md-0"}
    await registry.r.sadd(INSTANCES, "md-2")  # read as gone, then written again before the drop
    await registry.heartbeat(InstanceInfo("md-2", "md", "B"))
    assert [i.id for i in await registry.alive()] == ["md-0", "md-2"]
    await registry.remove("md-0")
    assert await registry.r.smembers(INSTANCES) == {"md-2"}
