"""`pdd up`'s line on the KV pools' memory (pdd/footprint.py), and the pool's memory committed as
its blocks are written (shared/runtime/memory.py)."""

from __future__ import annotations

import torch

from pdd import footprint
from shared.config import load_config
from shared.model_info import load_model_info
from shared.runtime.kv_pool import KVLayout, KVPool


def test_the_shipped_pools_are_counted_at_capacity_in_their_dtype():
    cfg = load_config(None)  # configs/single-host.yaml
    model = load_model_info(cfg.model)
    pools = footprint.pool_bytes(cfg)
    per_token = model.num_layers * 2 * model.kv_heads * model.head_dim
    expected = {i.id: i.kv_tokens * per_token * (4 if i.dtype == "float32" else 2) for i in cfg.instances}
    assert pools == expected and len(set(pools.values())) == 3  # fp32 prefill, bf16 decoders of two sizes


def test_pools_past_what_the_host_has_are_said_before_they_fill():
    pools = {"prefill-0": 3_000_000_000, "md-0": 2_000_000_000}
    line, fits = footprint.summary(pools, available=8_000_000_000)
    assert fits and "prefill-0 3.00, md-0 2.00 GB; 5.00 GB in all, 8.0 GB available" in line
    line, fits = footprint.summary(pools, available=4_000_000_000)
    assert not fits and "lower kv_tokens" in line
    assert footprint.summary(pools, available=None) == (
        "KV pools at capacity (resident as they fill): prefill-0 3.00, md-0 2.00 GB; 5.00 GB in all",
        True,
    )


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert footprint.available_bytes(meminfo) == 20_000_000 * 1024
    assert footprint.available_bytes(tmp_path / "absent") is None
    assert footprint.available_bytes() > 0  # this host's


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def test_a_pool_is_resident_as_its_blocks_are_written_not_when_it_is_made():
    before = _resident_bytes()
    pool = KVPool.with_capacity(KVLayout(30, 3, 64), tokens=32768, dtype=torch.float32)  # 1.5 GB
    made = _resident_bytes()
    assert pool.kv.numel() * 4 > 1_500_000_000 and made - before < 50_000_000
    assert not pool.kv[:, :, -pool.block_size :].any()  # reads as zeros (the scratch block, never written)
    pool.kv[:, :, : 100 * pool.block_size] = 1.0  # 1,600 tokens: ~74 MB
    written = _resident_bytes() - made
    # 60 planes (layer x K/V) of 1.2 MB each; on a host whose kernel backs anonymous memory with
    # 2 MB pages whatever it is advised, each plane's rows may take two: up to 240 MB, not 1.5 GB
    assert 70_000_000 < written < 400_000_000, written
    del pool
