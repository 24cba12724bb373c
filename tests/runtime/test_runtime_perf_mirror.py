"""The CPU decode mirror gives the logits the gather path gives, whatever happens around it.

Two runners over two pools, one with the mirror and one without (`mirror_bytes=0`), are driven
through the same steps; every step's logits must agree. The steps move the decode set around
(sequences skipping steps, leaving, joining), rewind and recompute a sequence with other tokens,
import KV into a decoding sequence's blocks, move a sequence to other blocks, and exceed the budget.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from shared.runtime import mirror
from shared.runtime.kv_payload import export_kv, import_kv
from shared.runtime.kv_pool import KVPool
from shared.runtime.mirror import IDLE_STEPS
from shared.runtime.models import kv_layout, tiny_llama
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, random_prompts

MODEL = tiny_llama()


class Twin:
    """The same sequences on a mirrored runner and a gathering one."""

    def __init__(self, mirror_bytes: int = 1 << 30) -> None:
        self.sides = [self._runner(mirror_bytes), self._runner(0)]
        self.seqs: dict[str, tuple[Sequence, Sequence]] = {}

    @staticmethod
    def _runner(mirror_bytes: int) -> ModelRunner:
        return ModelRunner(
            MODEL, KVPool(kv_layout(MODEL), 128, 16), mirror_bytes=mirror_bytes, cuda_graphs=False, invariant=False
        )

    @property
    def mirror(self):
        return self.sides[0].mirror

    def add(self, name: str, tokens: list[int]) -> None:
        pair = []
        for runner in self.sides:
            s = Sequence(name, list(tokens), greedy(64))
            s.block_table = runner.pool.allocator.allocate(runner.pool.blocks_for(len(tokens) + 64))
            pair.append(s)
        self.seqs[name] = tuple(pair)
        self.step({name: len(tokens)})

    def step(self, work: dict[str, int]) -> None:
        logits = []
        for side, runner in enumerate(self.sides):
            items = [(self.seqs[name][side], n) for name, n in work.items()]
            result = runner.forward(items)
            for seq, n in items:
                seq.num_computed += n
            for seq, token in zip(result.sampled, result.logits.argmax(-1).tolist()):
                seq.token_ids.append(token)
            logits.append(result.logits)
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)

    def decode(self, *names: str) -> None:
        self.step(dict.fromkeys(names, 1))


def _prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(MODEL.config.vocab_size, [7 + 13 * i for i in range(n)], seed=seed)


@pytest.mark.parametrize("mapped", [False, True], ids=["torch-memory", "mapped-memory"])
def test_decode_sets_that_change_every_step(monkeypatch, mapped):
    if mapped:  # this tiny model's rows stay under 2 MB: map them anyway, as a real model's are
        monkeypatch.setattr(mirror, "HUGE_PAGE", 0)
    t = Twin()
    for i, p in enumerate(_prompts(5, seed=30)):
        t.add(f"s{i}", p)
    for names in (["s0", "s1", "s2", "s3", "s4"], ["s0", "s2", "s4"], ["s1", "s3"], ["s4", "s0"], ["s3"]):
        t.decode(*names)
    for _ in range(IDLE_STEPS + 2):  # s1..s3 idle long enough to lose their rows
        t.decode("s0", "s4")
    assert sum(r is not None for r in t.mirror.rows) == 2
    t.add("s5", _prompts(1, seed=31)[0])
    t.decode("s5", "s0", "s4", "s2")  # s2 comes back: its row is filled again from the pool
    t.decode("s0", "s2", "s4", "s5")
    assert ("hg" in _vm_flags(t.mirror.kt)) == mapped


def _vm_flags(tensor: torch.Tensor) -> list[str]:
    """The kernel's flags for the mapping that holds `tensor` (/proc/self/smaps; "hg": madvised
    MADV_HUGEPAGE)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


def test_a_large_mirror_tensor_is_zeroed_mapped_memory_advised_for_huge_pages():
    t = mirror.zeros((4, 1 << 20), torch.float32, torch.device("cpu"))  # 16 MB
    assert t.shape == (4, 1 << 20) and t.dtype == torch.float32 and not t.any()
    assert "hg" in _vm_flags(t)
    gc.collect()  # the mapping lives as long as the tensor, not as the function that made it
    t[3, -1] = 1.0
    assert t.sum().item() == 1.0
    small = mirror.zeros((4, 4), torch.float32, torch.device("cpu"))
    assert "hg" not in _vm_flags(small) and not small.any()


def test_rows_stay_dense_when_rows_in_the_middle_leave():
    t = Twin()
    for i, p in enumerate(_prompts(8, seed=32)):
        t.add(f"s{i}", p)
    t.decode(*[f"s{i}" for i in range(8)])
    for _ in range(IDLE_STEPS + 2):
        t.decode("s0", "s7")  # rows 1..6 go idle and are freed
    used = [i for i, r in enumerate(t.mirror.rows) if r is not None]
    assert used == [0, 1]  # s7's row moved down instead of leaving six idle rows in the range
    t.decode("s7", "s0")


def test_rewound_sequence_recomputed_with_other_tokens():
    t = Twin()
    t.add("a", _prompts(1, seed=33)[0])
    for _ in range(4):
        t.decode("a")
    for side in (0, 1):  # back to 5 tokens before the end, with different tokens from there
        seq = t.seqs["a"][side]
        seq.token_ids = seq.token_ids[:-5] + [3, 4, 5, 6, 7]
        seq.num_computed = seq.num_tokens - 5
    t.step({"a": 5})  # an extend over positions the mirror's row already held
    t.decode("a")
    t.decode("a")


def test_imported_kv_and_moved_blocks_invalidate_rows():
    t = Twin()
    a, b = _prompts(2, seed=34)
    t.add("a", a)
    t.add("b", b)
    t.decode("a", "b")
    # overwrite a's KV with b's (a nonsense import, but it must be seen), then decode a again
    for side, runner in enumerate(t.sides):
        sa, sb = t.seqs["a"][side], t.seqs["b"][side]
        payload = export_kv(runner.pool, sb.block_table, 0, 16)
        import_kv(runner.pool, sa.block_table, payload.narrow(0, 16))
    t.decode("a", "b")
    # a moves to fresh blocks (its KV copied over): the row must not trust the old table
    for side, runner in enumerate(t.sides):
        sa = t.seqs["a"][side]
        payload = export_kv(runner.pool, sa.block_table, 0, sa.num_computed)
        new = runner.pool.allocator.allocate(len(sa.block_table))
        import_kv(runner.pool, new, payload)
        runner.pool.allocator.free(sa.block_table)
        sa.block_table = new
    t.decode("a", "b")
    t.decode("b", "a")


def test_over_budget_steps_fall_back_to_the_gather():
    t = Twin(mirror_bytes=64 * 1024)  # room for a few hundred tokens of this model's KV
    prompts = _prompts(4, seed=35)
    t.add("s0", prompts[0])
    t.decode("s0")
    assert t.mirror.kt is not None
    assert 0 < t.mirror.nbytes <= 64 * 1024  # what Inspect reports (mirror_bytes), within the budget
    for i, p in enumerate(prompts[1:], start=1):
        t.add(f"s{i}", p)
    t.decode("s0", "s1", "s2", "s3")
    assert t.mirror.kt is None and t.mirror.nbytes == 0  # did not fit: gathered, mirror emptied
    t.decode("s0")
    t.decode("s0", "s1", "s2", "s3")


def test_failed_step_clears_the_mirror():
    t = Twin()
    t.add("a", _prompts(1, seed=36)[0])
    t.decode("a")
    runner, seq = t.sides[0], t.seqs["a"][0]
    seq.token_ids[-1] = 10**6  # out of the vocabulary: the embedding lookup fails mid-step
    with pytest.raises(IndexError):
        runner.forward([(seq, 1)])
    assert runner.mirror.kt is None
