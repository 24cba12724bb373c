"""What the fast paths need from the pool: a scratch block nobody owns, a log of foreign writes,
whole-range KV transfers, block tables as tensors."""

from __future__ import annotations

import gc

import torch

from shared.runtime.kv_pool import KVLayout, KVPool

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=4)


def test_scratch_block_is_past_every_allocatable_block():
    pool = KVPool(LAYOUT, num_blocks=4, block_size=8)
    assert pool.kv.shape[2] == 5 * 8 and pool.scratch_slot == 4 * 8
    assert sorted(pool.allocator.allocate(4)) == [0, 1, 2, 3]
    tables = pool.table_tensor([[2, 0], [3]], num_blocks=3, rows=3)
    assert tables.tolist() == [[2, 0, 4], [3, 4, 4], [4, 4, 4]]  # cut/padded with the scratch block


def test_slot_list_equals_slots():
    pool = KVPool(LAYOUT, num_blocks=8, block_size=4)
    table = [5, 1, 7]
    assert pool.slot_list(table, 2, 11) == pool.slots(table, 2, 11).tolist()


def test_foreign_writes_are_logged_by_block_and_step_writes_are_not():
    pool = KVPool(LAYOUT, num_blocks=8, block_size=4)
    log, other = pool.track_writes(), pool.track_writes()
    k = torch.ones(3, 2, 4)
    pool.write(0, torch.tensor([1, 5, 6]), k, k)  # blocks 0 and 1
    pool.store(0, torch.tensor([20]), k[:1], k[:1])  # block 5, not logged
    pool.import_tokens(torch.tensor([13]), torch.zeros(3, 2, 1, 2, 4))  # block 3
    assert log.take() == {0, 1, 3} and log.take() == set()
    assert other.take() == {0, 1, 3}  # every subscriber sees every write
    del other
    gc.collect()
    pool.write(0, torch.tensor([30]), k[:1], k[:1])
    assert log.take() == {7} and len(pool._logs) == 1  # the dropped subscriber is forgotten


def test_export_then_import_all_layers_at_once_converts_dtype():
    src = KVPool(LAYOUT, num_blocks=8, block_size=4)
    src.kv.normal_()
    slots = src.slots([3, 6], 1, 7)
    kv = src.export_tokens(slots)
    assert kv.shape == (3, 2, 6, 2, 4)
    for layer in range(3):
        k, v = src.read(layer, slots)
        assert torch.equal(kv[layer, 0], k) and torch.equal(kv[layer, 1], v)
    dst = KVPool(LAYOUT, num_blocks=4, block_size=8, dtype=torch.bfloat16)
    dst_slots = dst.slots([2], 0, 6)
    dst.import_tokens(dst_slots, kv)
    assert torch.equal(dst.export_tokens(dst_slots), kv.to(torch.bfloat16))


def test_read_into_reused_buffers_matches_a_fresh_read():
    pool = KVPool(LAYOUT, num_blocks=8, block_size=4)
    pool.kv.normal_()
    slots = torch.tensor([[3, 9, 4], [0, 1, 2]])
    buffers = (torch.empty(10, 2, 4), torch.empty(10, 2, 4))
    k, v = pool.read(2, slots, out=buffers)
    k0, v0 = pool.read(2, slots)
    assert k.shape == (2, 3, 2, 4) and torch.equal(k, k0) and torch.equal(v, v0)
