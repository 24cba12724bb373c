"""Pool accounting: blocks come back, refcounts share, exhaustion is clean."""

from __future__ import annotations

import pytest
import torch

from shared.messages import Sampling
from shared.runtime.kv_pool import BlockAllocator, KVLayout, KVPool, PoolExhausted
from shared.runtime.sequence import Sequence
from tests.helpers import make_engine, random_prompts, reference_generate, run_to_completion, seq


def test_capacity_in_tokens_or_bytes():
    layout = KVLayout(num_layers=30, kv_heads=3, head_dim=64)
    assert layout.bytes_per_token(torch.float32) == 46_080  # SmolLM2 figure from the design
    assert layout.bytes_per_token(torch.bfloat16) == 23_040
    by_tokens = KVPool.with_capacity(KVLayout(2, 2, 8), tokens=100, block_size=16)
    assert by_tokens.num_blocks == 6
    by_bytes = KVPool.with_capacity(KVLayout(2, 2, 8), bytes_=KVLayout(2, 2, 8).bytes_per_token(torch.float32) * 64)
    assert by_bytes.num_blocks == 4
    with pytest.raises(ValueError, match="exactly one"):
        KVPool.with_capacity(KVLayout(2, 2, 8))
    with pytest.raises(ValueError, match="below one block"):
        KVPool.with_capacity(KVLayout(2, 2, 8), tokens=3)


def test_refcounts_share_blocks():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.incref(a)  # a second owner, e.g. the radix cache
    alloc.free(a)
    assert alloc.num_free == 2 and all(alloc.refcount(b) == 1 for b in a)
    alloc.free(a)
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    with pytest.raises(PoolExhausted, match="need 5 blocks, 4 of 4 free"):
        alloc.allocate(5)
    assert alloc.num_free == 4  # a failed allocation takes nothing


def test_every_block_returns_after_mixed_work(tiny):
    engine = make_engine(tiny, num_blocks=64)
    for i, p in enumerate(random_prompts(tiny.config.vocab_size, [10, 50, 33, 7], seed=20)):
        engine.add(seq(str(i), p, 9))
    engine.step()
    engine.abort("1")  # aborted mid-way
    run_to_completion(engine)
    assert engine.pool.num_free_blocks == 64
    assert not engine.running and not engine.held


def test_request_larger_than_pool_fails_clearly(tiny):
    engine = make_engine(tiny, num_blocks=4, block_size=16)  # 64 tokens
    [big] = random_prompts(tiny.config.vocab_size, [60], seed=21)
    engine.add(seq("big", big, 10))
    [out] = engine.step()
    assert out.finish_reason == "error" and "more than the pool holds" in out.error
    assert engine.pool.num_free_blocks == 4


def test_exhaustion_queues_without_corrupting_running_sequences(tiny, tiny_ref):
    """Two requests that cannot both fit: the second waits, both outputs stay exact."""
    engine = make_engine(tiny, num_blocks=6, block_size=16)  # 96 tokens
    p1, p2 = random_prompts(tiny.config.vocab_size, [40, 45], seed=22)
    engine.add(seq("one", p1, 10))
    engine.add(seq("two", p2, 10))
    [first] = engine.step()
    assert list(engine.running) == ["one"] and [s.seq_id for s in engine.waiting] == ["two"]
    outs = run_to_completion(engine)
    assert [first.token_id] + outs["one"] == reference_generate(tiny_ref, p1, 10)
    assert outs["two"] == reference_generate(tiny_ref, p2, 10)
    assert engine.pool.num_free_blocks == 6


def test_hold_kv_keeps_blocks_until_released(tiny):
    engine = make_engine(tiny, num_blocks=16)
    s = Sequence("p", [5, 6, 7, 8, 9], Sampling(max_tokens=50), hold_kv=True, max_new=1)
    engine.add(s)
    [out] = engine.step()
    assert out.finish_reason == "length" and out.index == 0
    assert engine.pool.num_free_blocks < 16 and "p" in engine.held
    engine.release("p")
    assert engine.pool.num_free_blocks == 16


def test_duplicate_sequence_id_is_refused(tiny):
    engine = make_engine(tiny)
    engine.add(seq("x", [1, 2, 3], 2))
    with pytest.raises(ValueError, match="already"):
        engine.add(seq("x", [1, 2, 3], 2))
