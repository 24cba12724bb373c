"""Tenants do not share cached KV unless they share a cache salt, and the prefix index cannot be
probed with a guessed prompt (its hashes are keyed with the cluster's secret)."""

from __future__ import annotations

from shared.prefix_hash import block_hashes, namespace_of
from shared.runtime.radix_cache import RadixCache
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, make_engine, random_prompts, run_to_completion


def cached_engine(model, key: bytes = b""):
    e = make_engine(model, namespace="m")
    e.cache = RadixCache(e.pool.allocator, e.pool.block_size, hash_key=key)
    return e


def test_keyed_hashes_cannot_be_computed_without_the_key():
    tokens = list(range(64))
    plain, keyed = block_hashes(tokens, 16, "m"), block_hashes(tokens, 16, "m", key=b"k" * 32)
    assert len(keyed) == 4 and not set(plain) & set(keyed)
    assert keyed == block_hashes(tokens, 16, "m", key=b"k" * 32)  # the instances and the scheduler agree
    assert block_hashes(tokens, 16, namespace_of("m", "tenant-a")) != block_hashes(tokens, 16, namespace_of("m", "b"))


def test_the_radix_cache_publishes_keyed_hashes(tiny):
    e = cached_engine(tiny, key=b"secret")
    [prompt] = random_prompts(tiny.config.vocab_size, [40], seed=1)
    e.add(Sequence("a", list(prompt), greedy(2)))
    run_to_completion(e)
    stored = [h for ev in e.cache.drain_events() if ev.kind == "stored" for h in ev.hashes]
    assert stored[:2] == block_hashes(prompt, 16, e.namespace, key=b"secret")[:2]


def test_a_tenant_hits_only_its_own_cached_prefix(tiny):
    e = cached_engine(tiny)
    [prompt] = random_prompts(tiny.config.vocab_size, [48], seed=2)

    def run(rid: str, salt: str) -> Sequence:
        seq = Sequence(rid, list(prompt), greedy(2), namespace=namespace_of("m", salt))
        e.add(seq)
        run_to_completion(e)
        return seq

    assert run("a1", "tenant-a").cached_tokens == 0
    assert run("b1", "tenant-b").cached_tokens == 0  # tenant A's prompt, but not tenant A
    assert run("a2", "tenant-a").cached_tokens == 32
