"""benchmarks/kernels_bench.py's report: the table, the checks' verdicts and the layers.c ratios,
from recorded samples (the bench itself loads six runners; `make bench-runtime` runs it)."""

from __future__ import annotations

from benchmarks import kernels_bench as kb


def _samples(plan: kb.Plan, ms: dict[str, float]) -> dict[str, list[float]]:
    """Three rounds per case; a case's ms from `ms` by runner kind."""
    cases = [f"decode b={b}" for b in plan.batches] + [f"prefill {n}" for n in plan.prefill_lens]
    return {f"{kind} {case}": [ms[kind] * (1 + i / 100) for i in range(3)] for kind in ms for case in cases}


def test_the_report_gives_each_check_its_verdict_and_the_stack_against_the_loop():
    plan = kb.Plan(python_loop=True)
    ms = {
        "float32 invariant": 40.0,
        "float32 fastest": 50.0,
        "bfloat16 invariant": 20.0,
        "bfloat16 fastest": 30.0,
        f"float32 {kb.LOOP}": 80.0,
        f"bfloat16 {kb.LOOP}": 25.0,
    }
    text = kb.report(_samples(plan, ms), plan)
    assert "| decode b=1 | 0.50x [0.50..0.50] (loop 80.8 [80.0..81.6])" in text
    assert "| 0.80x [0.80..0.80] (loop 25.2 [25.0..25.5])" in text
    f_line = next(line for line in text.splitlines() if line.startswith("| (f)"))
    assert "0.40x" in f_line and f_line.endswith("| ok |")  # 20 / 50
    g_line = next(line for line in text.splitlines() if line.startswith("| (g)"))
    assert "1.00x" in g_line and g_line.endswith("| ok |")  # every case costs the same here
    h_line = next(line for line in text.splitlines() if line.startswith("| (h) fp32 invariant prefill 512"))
    assert h_line.endswith("| ok |")


def test_without_the_loop_runners_the_report_has_no_loop_table():
    plan = kb.Plan()
    ms = {"float32 invariant": 60.0, "float32 fastest": 50.0, "bfloat16 invariant": 20.0, "bfloat16 fastest": 30.0}
    text = kb.report(_samples(plan, ms), plan)
    assert "Python loop" not in text
    h_line = next(line for line in text.splitlines() if line.startswith("| (h) fp32 invariant prefill 2048"))
    assert "1.20x" in h_line and h_line.endswith("| FAIL |")
