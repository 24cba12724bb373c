"""skinny.c, the GEMM for decode steps on CPU (shared/runtime/skinny.py; fp32 weights here, bf16 in
test_invariant.py): it computes what
F.linear does for every row count and shape it takes, the same bits for a row whatever the batch
around it, and where it cannot be built it says why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.runtime import skinny


@pytest.fixture(scope="module")
def kernel():
    reason = skinny.unavailable_reason()
    if reason is not None:  # the suite runs where a C compiler is (make setup's machine, CI)
        pytest.fail(f"skinny.c does not build here: {reason}")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("k", [1, 37, 576])
@pytest.mark.parametrize("n", [32, 96, 160])
def test_matches_f_linear_at_every_row_count(kernel, n, k):
    """1-17 rows cover every tile (1-8, 12) and every split of a pass (9-11 as 8 + rest, 13-17 as
    12 + rest); 24, 64 and 130 rows take several 12-row passes."""
    w, b = _weight(n, k), torch.randn(n)
    packed = skinny.pack(w)
    for rows in [*range(1, 18), 24, 64, 130]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(skinny.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(skinny.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_avx2_build_matches_f_linear(kernel, fresh_load):
    """The build for CPUs without AVX-512 (2 rows per pass, v16 as two registers), run here."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not {"avx2", "fma"} <= set(flags.split()):
        pytest.fail("this test needs an x86 CPU with AVX2 (the suite runs on one)")
    haswell = tuple("-march=haswell" if f == "-march=native" else f for f in skinny.FLAGS)  # AVX2 + FMA
    fn = skinny._bind(skinny._build("cc", haswell))
    w = _weight(96, 200)
    packed = skinny.pack(w)
    for rows in (1, 2, 3, 8, 13):
        x = torch.randn(rows, 200)
        torch.testing.assert_close(skinny.linear(x, packed, fn=fn), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert torch.equal(skinny.linear(x, packed, fn=fn)[-1:], skinny.linear(x[-1:], packed, fn=fn))


def test_a_row_gets_the_same_bits_in_any_batch_and_with_any_thread_count(kernel):
    """Each output is one sum over k in order, whatever tile its row falls in: a sequence's logits
    do not depend on which other sequences share its decode step."""
    w = _weight(3072, 576)
    packed = skinny.pack(w)
    x = torch.randn(16, 576)
    alone = torch.cat([skinny.linear(x[i : i + 1], packed) for i in range(16)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (16, 11, 5):
                assert torch.equal(skinny.linear(x[:rows], packed), alone[:rows]), f"{rows} rows, {t} threads"
    finally:
        torch.set_num_threads(threads)


def test_inputs_views_and_empty_batches(kernel):
    w = _weight(64, 40)
    packed = skinny.pack(w)
    x = torch.randn(40, 6).t()  # not contiguous
    torch.testing.assert_close(skinny.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert skinny.linear(torch.empty(0, 40), packed).shape == (0, 64)
    for wrong in (torch.randn(3, 41), torch.randn(3, 40, dtype=torch.float64)):  # C reads raw memory: refused
        with pytest.raises(ValueError, match="fp32 CPU inputs"):
            skinny.linear(wrong, packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        skinny.pack(torch.randn(48, 40))  # the last 16 columns would never be written


def test_which_weights_it_takes():
    assert skinny.supports(torch.empty(64, 8))
    assert not skinny.supports(torch.empty(48, 8))  # outputs not a multiple of 32
    assert skinny.supports(torch.empty(64, 8, dtype=torch.bfloat16))
    assert not skinny.supports(torch.empty(64, 8, dtype=torch.float16))
    assert skinny.pack(torch.arange(64.0 * 3).view(64, 3))[1, 2, 5].item() == (16 + 5) * 3 + 2


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """skinny._load forgets its library for the test (and again after it); builds go to tmp_path."""
    monkeypatch.setenv("PDD_KERNEL_CACHE", str(tmp_path))
    skinny._load.cache_clear()
    yield tmp_path
    skinny._load.cache_clear()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PDD_SKINNY": "0"}, "turned off by PDD_SKINNY=0"),
        ({"CC": "/nonexistent/cc"}, "no C compiler"),
        ({"CC": "false"}, "could not build or load skinny.c"),  # a compiler that fails
    ],
)
def test_without_a_build_it_says_why(fresh_load, monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert expected in skinny.unavailable_reason()
    with pytest.raises(skinny.Unavailable, match=expected):
        skinny.linear(torch.randn(1, 8), skinny.pack(torch.randn(32, 8)))
    assert not list(fresh_load.glob("*.so"))  # nothing half-built left in the cache


def test_one_build_per_cpu_in_a_shared_cache(kernel, fresh_load, monkeypatch):
    built = skinny._build("cc")
    mtime = built.stat().st_mtime_ns
    assert skinny._build("cc") == built and built.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: b"flags : another cpu")
    assert skinny._build("cc") != built  # a CPU with other features gets its own build
    assert sorted(p.name for p in fresh_load.iterdir()) == sorted(p.name for p in fresh_load.glob("skinny-*.so"))


def test_the_runtime_bench_profile_counts_it_as_projections(kernel):
    """A ctypes call is no torch op: under torch.profiler it is recorded by name, and the runtime
    bench's `--profile` files that name under projections (not under Python and dispatch)."""
    from torch.profiler import profile

    from benchmarks import runtime_report

    packed = skinny.pack(_weight(64, 32))
    with profile() as prof:
        skinny.linear(torch.randn(4, 32), packed)
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    assert self_us.get(skinny.PROFILER_NAME, 0) > 0
    categories = runtime_report.categorize(self_us, sum(self_us.values()))
    assert categories["projections (GEMM)"] >= self_us[skinny.PROFILER_NAME]
