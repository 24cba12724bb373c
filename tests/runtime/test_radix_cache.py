"""Radix cache: longest-prefix match, stored once, never evicting blocks in use, LRU, namespaces,
chained-hash events — and the engine reusing cached prefixes with exact outputs."""

from __future__ import annotations

from shared.prefix_hash import block_hashes
from shared.runtime.kv_pool import BlockAllocator
from shared.runtime.radix_cache import RadixCache
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, make_engine, random_prompts, reference_generate, run_to_completion

BS = 4


def _cache(num_blocks: int = 32) -> tuple[RadixCache, BlockAllocator]:
    alloc = BlockAllocator(num_blocks)
    return RadixCache(alloc, BS), alloc


def _insert(cache: RadixCache, alloc: BlockAllocator, tokens: list[int], ns: str = "") -> list[int]:
    blocks = alloc.allocate(len(tokens) // BS)
    cache.insert(tokens, blocks, ns)
    alloc.free(blocks)  # the request ends; the cache keeps its own reference
    return blocks


def test_longest_prefix_match_and_refcounts():
    cache, alloc = _cache()
    a = list(range(12))
    blocks = _insert(cache, alloc, a)
    assert alloc.num_free == 32 - 3 and cache.num_blocks == 3
    got = cache.match(a[:8] + [99, 98, 97, 96])
    assert got == blocks[:2] and all(alloc.refcount(b) == 2 for b in got)
    assert cache.match([7, 7, 7, 7]) == []
    assert cache.match(a[:7]) == blocks[:1]  # only full blocks count


def test_duplicate_prefix_is_stored_once():
    cache, alloc = _cache()
    system = list(range(100, 108))
    _insert(cache, alloc, system + [1, 2, 3, 4])
    stored = cache.insert(system + [5, 6, 7, 8], alloc.allocate(3))
    assert stored == 1 and cache.num_blocks == 4  # the shared 2 blocks once, two different tails


def test_blocks_in_use_are_never_evicted_and_lru_goes_first():
    cache, alloc = _cache()
    old, new = _insert(cache, alloc, [1] * 8), _insert(cache, alloc, [2] * 8)
    in_use = cache.match([2] * 8)
    assert cache.evict(10) == 2  # only the unused conversation's blocks
    assert alloc.refcount(in_use[0]) == 2 and cache.match([1] * 8) == []
    alloc.free(in_use)
    cache.match([2] * 4)  # touch
    alloc.free(cache.match([2] * 4))
    assert cache.evict(1) == 1 and cache.num_blocks == 1  # a leaf first: block 2 of [2]*8
    assert set(old) <= set(range(32)) and new


def test_eviction_follows_last_use_not_insertion_or_block_order():
    """Three unused prefixes, the oldest used again since: the one least recently used goes
    first, then the next; the re-used one (oldest inserted, lowest block ids) stays."""
    cache, alloc = _cache()
    a, b, c = ([n] * BS for n in (1, 2, 3))
    blocks = {name: _insert(cache, alloc, t) for name, t in (("a", a), ("b", b), ("c", c))}
    alloc.free(cache.match(a))  # a request reused a and finished: a is now the most recent
    assert cache.evict(1) == 1 and cache.match(b) == [] and cache.num_blocks == 2
    assert alloc.refcount(blocks["b"][0]) == 0
    alloc.free(cache.match(c))  # c is used again: a is now the least recent
    assert cache.evict(1) == 1 and cache.match(a) == []
    assert cache.match(c) == blocks["c"] and cache.num_blocks == 1


def test_namespaces_do_not_share():
    cache, alloc = _cache()
    _insert(cache, alloc, list(range(8)), ns="tenant-a")
    assert cache.match(list(range(8)), "tenant-b") == []
    assert len(cache.match(list(range(8)), "tenant-a")) == 2


def test_events_carry_chained_hashes_like_the_scheduler_computes():
    cache, alloc = _cache()
    tokens = list(range(16))
    _insert(cache, alloc, tokens, ns="m")
    first, rest = cache.drain_events()
    assert first.kind == rest.kind == "stored" and first.hashes + rest.hashes == block_hashes(tokens, BS, "m")
    assert first.first and len(first.hashes) == 1 and not rest.first  # it opens the chain: indexed by it
    assert block_hashes(tokens, BS, "other") != first.hashes + rest.hashes
    cache.evict(4)
    removed = cache.drain_events()
    assert {e.kind for e in removed} == {"removed"}
    assert sorted(h for e in removed for h in e.hashes) == sorted(first.hashes + rest.hashes)
    assert [e.hashes for e in removed if e.first] == [first.hashes]


def test_only_a_chains_first_block_is_marked_first_in_every_event():
    """Stored, removed and a resync's whole cache: the chains' first blocks (under a namespace's
    root) come in events marked `first`, the rest in unmarked ones."""
    cache, alloc = _cache()
    tokens = list(range(3 * BS))
    hashes = block_hashes(tokens, BS, "m")
    _insert(cache, alloc, tokens[:BS], ns="m")
    cache.drain_events()
    _insert(cache, alloc, tokens, ns="m")  # extends the chain: nothing here opens one
    assert [(e.kind, e.first, e.hashes) for e in cache.drain_events()] == [("stored", False, hashes[1:])]
    _insert(cache, alloc, tokens[:BS], ns="n")  # another namespace: a chain of its own
    assert [(e.first, e.hashes) for e in cache.drain_events()] == [(True, block_hashes(tokens[:BS], BS, "n"))]
    cleared, *stored = cache.all_events()
    assert cleared.kind == "cleared" and [e.kind for e in stored] == ["stored", "stored"]
    assert sorted(stored[0].hashes) == sorted([hashes[0], *block_hashes(tokens[:BS], BS, "n")]) and stored[0].first
    assert sorted(stored[1].hashes) == sorted(hashes[1:]) and not stored[1].first
    cache.evict(10)
    removed = cache.drain_events()
    assert {(e.kind, e.first, h) for e in removed for h in e.hashes} == {
        *(("removed", True, h) for h in stored[0].hashes),
        *(("removed", False, h) for h in stored[1].hashes),
    }


def test_engine_reuses_prefix_and_stays_exact(tiny, tiny_ref):
    engine = make_engine(tiny, num_blocks=64, block_size=16)
    engine.cache = RadixCache(engine.pool.allocator, 16)
    system, q1, q2 = random_prompts(tiny.config.vocab_size, [40, 7, 9], seed=40)
    engine.add(Sequence("t1", system + q1, greedy(10)))
    out1 = run_to_completion(engine)["t1"]
    turn2 = system + q1 + out1 + q2
    s2 = Sequence("t2", list(turn2), greedy(10))
    engine.add(s2)
    out2 = run_to_completion(engine)["t2"]
    assert out1 == reference_generate(tiny_ref, system + q1, 10)
    assert out2 == reference_generate(tiny_ref, turn2, 10)
    assert s2.cached_tokens == (len(system + q1 + out1) - 1) // 16 * 16  # the whole first turn, by block


def test_engine_evicts_cached_prefixes_when_the_pool_is_short(tiny, tiny_ref):
    engine = make_engine(tiny, num_blocks=8, block_size=16)  # 128 tokens
    engine.cache = RadixCache(engine.pool.allocator, 16)
    prompts = random_prompts(tiny.config.vocab_size, [60, 60, 60], seed=41)
    for i, p in enumerate(prompts):
        engine.add(Sequence(str(i), list(p), greedy(8)))
        assert run_to_completion(engine)[str(i)] == reference_generate(tiny_ref, p, 8)
    assert engine.cache.num_blocks + engine.pool.num_free_blocks == 8  # nothing leaked
    engine.cache.evict(8)
    assert engine.pool.num_free_blocks == 8


def test_hole_is_computed_before_the_imported_range(tiny, tiny_ref):
    """A prefix evicted mid-flight: KV of [32, 48) arrived but [16, 32) must be recomputed."""
    from shared.runtime.kv_payload import export_kv, import_kv

    [prompt] = random_prompts(tiny.config.vocab_size, [48], seed=42)
    expected = reference_generate(tiny_ref, prompt, 6)
    sender = make_engine(tiny)
    p = Sequence("p", list(prompt), greedy(1), hold_kv=True)
    sender.add(p)
    run_to_completion(sender)
    head, tail = export_kv(sender.pool, p.block_table, 0, 16), export_kv(sender.pool, p.block_table, 32, 48)
    receiver = make_engine(tiny)
    s = Sequence("d", list(prompt) + expected[:1], greedy(6), prompt_len=48)
    s.block_table = receiver.allocate(3)
    import_kv(receiver.pool, s.block_table, head)
    import_kv(receiver.pool, s.block_table, tail)
    s.num_computed, s.imported = 16, (32, 48)
    receiver.add(s)
    assert expected[:1] + run_to_completion(receiver)["d"] == expected
