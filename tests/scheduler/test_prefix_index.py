"""The prefix index's lookup (shared/registry.py), against a real redis-server: block hashes are
chained, so an instance holds a prefix only up to its first missing block; a block it holds
after a gap is no part of that prefix and must not count."""

from __future__ import annotations

from shared.messages import IndexEvent
from shared.registry import Registry

HASHES = ["b0", "b1", "b2", "b3"]  # the prompt's chained block hashes, in order


FIRSTS = {"b0", "c0", "e0"}  # the chains' first blocks, as a radix cache marks them (`first`)


async def holds(registry: Registry, instance_id: str, hashes: list[str]) -> None:
    firsts = [h for h in hashes if h in FIRSTS]
    events = [IndexEvent("cleared"), IndexEvent("stored", firsts, first=True)]
    await registry.apply_kv_events(instance_id, events + [IndexEvent("stored", [h for h in hashes if h not in FIRSTS])])


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


async def test_only_the_first_blocks_holders_are_asked_and_they_leave_with_their_index(registry):
    """The lookup finds an instance through the first blocks' index: one whose first block was
    never marked as one is not found, a removed first block or a cleared index takes it out,
    and an instance that is not asked about (gone) is not reported."""
    await holds(registry, "md-0", HASHES)
    await holds(registry, "md-1", HASHES)
    await registry.apply_kv_events("md-2", [IndexEvent("stored", HASHES)])  # not marked: not indexed
    assert await registry.prefix_blocks(["md-0", "md-1", "md-2"], HASHES) == {"md-0": 4, "md-1": 4}
    assert await registry.prefix_blocks(["md-1", "md-2"], HASHES) == {"md-1": 4}  # md-0 not asked
    await registry.apply_kv_events("md-0", [IndexEvent("removed", ["b0"], first=True)])
    await registry.apply_kv_events("md-1", [IndexEvent("cleared")])
    assert await registry.prefix_blocks(["md-0", "md-1", "md-2"], HASHES) == {}
    assert await registry.r.smembers("pdd:first:b0") == set()  # neither is left in the first blocks' index
    assert not await registry.r.exists("pdd:kv:md-1:firsts")


async def test_a_holder_whose_index_expired_counts_nothing(registry):
    """An instance that died keeps its entry in the first blocks' index until it comes back and
    clears it; its block set expired, so the lookup counts nothing for it."""
    await holds(registry, "md-0", HASHES)
    await registry.r.delete("pdd:kv:md-0")  # expired
    assert await registry.r.smembers("pdd:first:b0") == {"md-0"}
    assert await registry.prefix_blocks(["md-0"], HASHES) == {}
    await holds(registry, "md-0", HASHES[:2])  # back: its cleared index leaves no stale entry behind
    assert await registry.prefix_blocks(["md-0"], HASHES) == {"md-0": 2}


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
