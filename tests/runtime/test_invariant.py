"""Batch invariance: a row's bits do not depend on its batch, the thread count, or whether it is a
decode step or one position of an extend, in float32 and bfloat16.

Kernel by kernel (rows.c's attention and RMSNorm, skinny.c with bf16 weights), then the model:
the KV an extend writes equals the KV step-by-step decoding wrote, and greedy tokens alone equal
those in a batch of 16, on the runtime's default CPU path.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shared.runtime import rows, skinny
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, tiny_llama
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, make_engine, random_prompts

DTYPES = [torch.float32, torch.bfloat16]
H, KVH, D, BLOCK = 9, 3, 64, 16  # SmolLM2's attention


@pytest.fixture(scope="module", autouse=True)
def kernels():
    for reason in (skinny.unavailable_reason(), rows.unavailable_reason()):
        if reason is not None:  # the suite runs where a C compiler is (make setup's machine, CI)
            pytest.fail(f"the batch-invariant kernels do not build here: {reason}")


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pool(dtype: torch.dtype, slots: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, KVH, D, generator=g).to(dtype), torch.randn(slots, KVH, D, generator=g).to(dtype))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], keys: int) -> torch.Tensor:
    slots = torch.tensor([table[j // BLOCK] * BLOCK + j % BLOCK for j in range(keys)])
    kk = k[slots].float().repeat_interleave(H // KVH, dim=1)
    vv = v[slots].float().repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, kk) * 0.125
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), vv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_bits_of_a_row_alone_batched_threaded_and_in_any_extend(dtype):
    k, v = _pool(dtype)
    g = torch.Generator().manual_seed(1)
    table = torch.randperm(4096 // BLOCK, generator=g)[:20].tolist()  # a scattered block table
    start = 150
    q = torch.randn(100, H, D, generator=g)
    alone = torch.cat(
        [rows.attend(q[i : i + 1], k, v, rows.plan([(table, start + i + 1)]), BLOCK, 0.125) for i in range(100)]
    )
    for i in (0, 37, 99):
        torch.testing.assert_close(alone[i], _reference(q[i], k, v, table, start + i + 1), rtol=1e-5, atol=1e-5)
    others = [torch.randperm(4096 // BLOCK, generator=g)[:20].tolist() for _ in range(15)]
    lengths = torch.randint(1, 300, (15,), generator=g).tolist()
    for threads in (1, 2):
        with _threads(threads):
            for n in (1, 2, 7, 16, 33, 100):  # an extend of n tokens ending at row 99
                first = 100 - n
                plan = rows.plan([(table, start + i + 1) for i in range(first, 100)])
                got = rows.attend(q[first:], k, v, plan, BLOCK, 0.125)
                assert torch.equal(got, alone[first:]), f"extend of {n}, {threads} threads"
            for batch in (2, 5, 16):  # decode rows beside batch - 1 other sequences
                mates, at = list(zip(others, lengths))[: batch - 1], min(3, batch - 1)
                plan = rows.plan([*mates[:at], (table, start + 50), *mates[at:]])
                qs = torch.cat([torch.randn(at, H, D), q[49:50], torch.randn(batch - 1 - at, H, D)])
                got = rows.attend(qs, k, v, plan, BLOCK, 0.125)
                assert torch.equal(got[at], alone[49]), f"batch {batch}, {threads} threads"


def test_attention_refuses_what_it_cannot_read():
    k, v = _pool(torch.float32, 64)
    with pytest.raises(ValueError, match="query rows"):
        rows.attend(torch.randn(2, H, D), k, v, rows.plan([([0], 3)]), BLOCK, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        rows.attend(torch.randn(1, 3, 24), torch.randn(64, 1, 24), torch.randn(64, 1, 24), rows.plan([([0], 3)]), 16, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_bits_of_a_row_do_not_depend_on_the_rows_beside_it(threads):
    x, w = torch.randn(33, 576), torch.randn(576)
    with _threads(threads):
        together = rows.rms_norm(x, w, 1e-5)
    alone = torch.cat([rows.rms_norm(x[i : i + 1], w, 1e-5) for i in range(33)])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_skinny_takes_bf16_weights_with_fp32_sums_and_the_same_bits_in_any_batch():
    w = (torch.randn(960, 576) * 0.05).to(torch.bfloat16)
    b = torch.randn(960).to(torch.bfloat16)
    packed = skinny.pack(w)
    assert packed.dtype == torch.bfloat16 and packed.nbytes == w.nbytes  # half the bytes of fp32
    x = torch.randn(130, 576)
    torch.testing.assert_close(skinny.linear(x, packed, b), F.linear(x, w.float(), b.float()), rtol=1e-4, atol=1e-4)
    alone = torch.cat([skinny.linear(x[i : i + 1], packed) for i in range(130)])
    for threads in (1, 2):
        with _threads(threads):
            for m in (2, 8, 13, 16, 97, 130):  # tiles, splits, and more than one 96-row sweep
                assert torch.equal(skinny.linear(x[:m], packed), alone[:m]), f"{m} rows, {threads} threads"


# -- the model ------------------------------------------------------------------------------


def _runner(model: torch.nn.Module, dtype: torch.dtype) -> ModelRunner:
    runner = ModelRunner(model, KVPool(kv_layout(model), 64, BLOCK, dtype))
    assert runner.invariant and runner.mirror is None  # the CPU default
    return runner


def _kv_of(runner: ModelRunner, s: Sequence, n: int) -> torch.Tensor:
    slots = runner.pool.slots(s.block_table, 0, n)
    return runner.pool.kv[:, :, slots].clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_extend_writes_the_kv_that_decoding_wrote_and_ends_on_the_same_logits(smol_dir, dtype):
    """The premise of the handoff: main-decode's one extend over the relay's tokens recomputes the
    relay's KV bit for bit, and samples from the same logits."""
    model = load_model(smol_dir, dtype=dtype)
    prompt, n = random_prompts(model.config.vocab_size, [40], seed=3)[0], 24
    relay, main = _runner(model, dtype), _runner(model, dtype)
    a = Sequence("a", list(prompt), greedy(n))
    a.block_table = relay.pool.allocator.allocate(relay.pool.blocks_for(len(prompt) + n))
    logits = None
    for step in range(n):  # prefill the prompt, then one token per step
        work = len(prompt) if step == 0 else 1
        logits = relay.forward([(a, work)]).logits[0]
        a.num_computed += work
        a.token_ids.append(int(logits.argmax()))
    b = Sequence("b", list(prompt), greedy(n))
    b.block_table = main.pool.allocator.allocate(main.pool.blocks_for(len(prompt) + n))
    main.forward([(b, len(prompt))])  # the prompt's KV, as prefill sent it
    b.num_computed = len(prompt)
    b.token_ids = a.token_ids[:-1]  # the relay's tokens; the last is what both must sample
    again = main.forward([(b, n - 1)]).logits[0]  # one extend over them
    computed = len(prompt) + n - 1
    assert torch.equal(_kv_of(main, b, computed), _kv_of(relay, a, computed))
    assert torch.equal(again, logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_alone_equal_those_in_a_batch_of_16(smol_dir, dtype):
    """The tokens and their logprobs (the sampled token's and the top 5), to the last bit."""
    model = load_model(smol_dir, dtype=dtype)
    prompts = random_prompts(model.config.vocab_size, [5 + 9 * i for i in range(16)], seed=4)
    params = dataclasses.replace(greedy(8), logprobs=5)

    def run(engine) -> dict[str, list]:
        outs: dict[str, list] = {}
        while engine.has_work:
            for o in engine.step():
                outs.setdefault(o.seq_id, []).append((o.token_id, o.logprob))
        return outs

    alone = {}
    for i in (0, 7, 15):
        engine = make_engine(model, 64, BLOCK, dtype)
        engine.add(Sequence(str(i), list(prompts[i]), params))
        alone.update(run(engine))
    engine = make_engine(model, 256, BLOCK, dtype)
    for i, p in enumerate(prompts):
        engine.add(Sequence(str(i), list(p), params))
    together = run(engine)
    assert {i: together[i] for i in alone} == alone
    assert all(lp is not None and len(lp.top_ids) == 5 for out in alone.values() for _, lp in out)


def test_a_model_the_kernels_do_not_take_runs_the_old_path_and_says_why(caplog):
    odd = tiny_llama(vocab_size=100)  # an LM head of 100 outputs: skinny.c takes multiples of 32
    runner = ModelRunner(odd, KVPool(kv_layout(odd), 16, BLOCK))
    assert not runner.invariant and "batch-invariant kernels off" in caplog.text and "100 outputs" in caplog.text
    with pytest.raises(ValueError, match="100 outputs"):
        ModelRunner(odd, KVPool(kv_layout(odd), 16, BLOCK), invariant=True)


def test_the_avx2_and_avx512_code_paths_give_the_same_bits(monkeypatch, tmp_path):
    """The kernels built 8 lanes wide for AVX2 (-march=haswell) and with the AVX-512 code path's
    16-lane vectors (-DVW=16, each fused multiply-add from two AVX2 halves where the CPU has no
    AVX-512): the same bits from each, so a fleet mixing the two CPUs answers alike; and the AVX2
    build is batch-invariant on its own (a row alone against an extend)."""
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not {"avx2", "fma"} <= set(flags.split()):
        pytest.fail("this test needs an x86 CPU with AVX2 (the suite runs on one)")
    monkeypatch.setenv("PDD_KERNEL_CACHE", str(tmp_path))
    haswell = tuple("-march=haswell" if f == "-march=native" else f for f in skinny.FLAGS)
    builds = {width: (*haswell, f"-DVW={width}") for width in (8, 16)}
    attention = {w: rows._Kernels(skinny._build("cc", f, source=rows.SOURCE)) for w, f in builds.items()}
    linear = {w: skinny._bind(skinny._build("cc", f)) for w, f in builds.items()}
    k, v = _pool(torch.bfloat16, 1024)
    table, q = list(range(10, 30)), torch.randn(40, H, D)
    x, w = torch.randn(5, 576), torch.randn(576)
    weight = skinny.pack((torch.randn(96, 576) * 0.05).to(torch.bfloat16))
    got = {}
    for width, kernels in attention.items():
        monkeypatch.setattr(rows, "_load", lambda kernels=kernels: (kernels, None))
        alone = torch.cat(
            [rows.attend(q[i : i + 1], k, v, rows.plan([(table, 60 + i + 1)]), BLOCK, 0.125) for i in range(40)]
        )
        extend = rows.attend(q, k, v, rows.plan([(table, 60 + i + 1) for i in range(40)]), BLOCK, 0.125)
        assert torch.equal(extend, alone), f"{width} lanes"
        torch.testing.assert_close(alone[7], _reference(q[7], k, v, table, 68), rtol=1e-5, atol=1e-5)
        norm = rows.rms_norm(x, w, 1e-5)
        assert torch.equal(norm[2:3], rows.rms_norm(x[2:3], w, 1e-5))
        got[width] = (alone, norm, skinny.linear(x, weight, fn=linear[width]))
    for a, b in zip(got[8], got[16], strict=True):
        assert torch.equal(a, b)


def test_the_runtime_bench_profile_counts_rows_c_as_attention():
    """ctypes calls are no torch ops: under torch.profiler they are recorded by name, and the
    runtime bench's `--profile` files attention under attention (not Python and dispatch)."""
    from torch.profiler import profile

    from benchmarks import runtime_report

    k, v = _pool(torch.float32, 64)
    with profile() as prof:
        rows.attend(torch.randn(2, H, D), k, v, rows.plan([([0, 1], 20), ([2], 5)]), BLOCK, 0.125)
        rows.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-5)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    assert self_us.get(rows.PROFILER_NAME, 0) > 0 and self_us.get(rows.NORM_PROFILER_NAME, 0) > 0
    categories = runtime_report.categorize(self_us, sum(self_us.values()))
    assert categories["attention matmuls, softmax"] >= self_us[rows.PROFILER_NAME]
