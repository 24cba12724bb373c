"""The runtime bench's report: the checks, the figures table with spreads, and a decode-step profile.

Every ratio a check uses is *paired*: the cases of a phase run round-robin (runtime b=1, b=8, ...,
transformers, then again), so round i gives one sample of each, and the check's figure is the
median over rounds of the per-round ratio. A stall of the shared machine then slows both sides
of a ratio in the same round instead of one figure. Rounds in which either side took more than
1.5x its fastest round are left out of the check (when at least three rounds remain); the check
prints how many rounds it used and the min..max of their ratios.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

NOISY_SPREAD = 1.5  # max / min of a case's samples above which the report asks for a rerun


@dataclass(frozen=True)
class Check:
    label: str
    num: str  # case names in the samples
    den: str
    limit: float
    at_least: bool = False  # True: the ratio must be >= limit (a speed-up), else <= limit


CHECKS = (
    Check("(a) runtime decode b=8 / b=1 step      ", "runtime decode b=8", "runtime decode b=1", 1.6),
    Check("(b) runtime decode b=16 / b=1 step     ", "runtime decode b=16", "runtime decode b=1", 2.2),
    Check("(c) runtime / transformers b=1 step    ", "runtime decode b=1", "transformers decode b=1", 1.05),
    Check("(d) prefill 512: transformers / runtime", "transformers prefill 512", "runtime prefill 512", 1.0, True),
    Check("(e) prefill 2048: transformers / runtime", "transformers prefill 2048", "runtime prefill 2048", 1.0, True),
)


def paired(samples: dict[str, list[float]], num: str, den: str) -> list[float]:
    """Per-round ratios num / den (the cases ran in the same rounds)."""
    return [a / b for a, b in zip(samples[num], samples[den])]


def clean_rounds(samples: dict[str, list[float]], names: tuple[str, ...]) -> list[int]:
    """Rounds in which each named case took at most NOISY_SPREAD x its fastest round: a stall of the
    shared machine that hit one side of a ratio makes that round's ratio meaningless."""
    n = len(samples[names[0]])
    return [i for i in range(n) if all(samples[c][i] <= NOISY_SPREAD * min(samples[c]) for c in names)]


def checks(samples: dict[str, list[float]]) -> dict:
    out = {}
    for c in CHECKS:
        if c.num not in samples or c.den not in samples:
            continue
        ratios = paired(samples, c.num, c.den)
        clean = clean_rounds(samples, (c.num, c.den))
        if len(clean) >= 3:
            ratios = [ratios[i] for i in clean]
        ratio = statistics.median(ratios)
        passed = ratio >= c.limit if c.at_least else ratio <= c.limit
        out[c.label.strip()] = {
            "ratio": ratio,
            "min": min(ratios),
            "max": max(ratios),
            "rounds": len(ratios),
            "of_rounds": len(samples[c.num]),
            "limit": c.limit,
            "at_least": c.at_least,
            "passed": passed,
        }
    return out


def spread(ts: list[float]) -> str:
    """`median [min..max]` of a case's samples, in ms."""
    return f"{statistics.median(ts):.1f} [{min(ts):.1f}..{max(ts):.1f}]"


def _ratio(samples: dict[str, list[float]], num: str, den: str) -> str:
    return f"{statistics.median(paired(samples, num, den)):.2f}x"


def table_rows(samples: dict[str, list[float]], plan: dict) -> list[tuple[str, ...]]:
    """(metric, runtime, transformers, rt/tf paired, note) per line; ms cells as median [min..max]."""
    med = statistics.median
    rows = []
    for n in plan["prefill_lens"]:
        rt, tf = f"runtime prefill {n}", f"transformers prefill {n}"
        note = f"{n * 1000 / med(samples[rt]):.0f} vs {n * 1000 / med(samples[tf]):.0f} tok/s"
        rows.append(
            (f"prefill {n} tokens (ms)", spread(samples[rt]), spread(samples[tf]), _ratio(samples, rt, tf), note)
        )
    for b in plan["decode_batches"]:
        rt, tf = f"runtime decode b={b}", "transformers decode b=1"
        cells = (spread(samples[tf]), _ratio(samples, rt, tf)) if b == 1 else ("-", "-")
        note = f"{_ratio(samples, rt, 'runtime decode b=1')} b=1, {b * 1000 / med(samples[rt]):.0f} tok/s"
        rows.append((f"decode b={b} ctx~{plan['context']} (ms/step)", spread(samples[rt]), *cells, note))
    for k in plan["extend_ks"]:
        rt, tf = f"runtime extend {k}", f"transformers extend {k}"
        note = f"{k * 1000 / med(samples[rt]):.0f} tok/s"
        rows.append(
            (
                f"extend k={k} on {plan['context']} (ms)",
                spread(samples[rt]),
                spread(samples[tf]),
                _ratio(samples, rt, tf),
                note,
            )
        )
    return rows


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    header = ("metric", "runtime median [min..max]", "transformers", "rt/tf", "note")
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    align = [str.ljust, str.rjust, str.rjust, str.rjust, str.ljust]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(align[j](cell, widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(rt/tf: median over rounds of the per-round ratio runtime / transformers; below 1 is faster)")
    return lines


def noisy_cases(samples: dict[str, list[float]]) -> list[str]:
    """Cases whose slowest sample took more than NOISY_SPREAD x their fastest."""
    return [
        f"{name}: {min(ts):.1f}..{max(ts):.1f} ms"
        for name, ts in samples.items()
        if len(ts) > 1 and max(ts) > NOISY_SPREAD * min(ts)
    ]


def format_checks(result: dict) -> list[str]:
    lines = []
    for c in CHECKS:
        r = result.get(c.label.strip())
        if r is None:
            continue
        verdict = "PASS" if r["passed"] else "FAIL"
        bound = ">=" if r["at_least"] else "<="
        spread_ = f"[{r['min']:.2f}..{r['max']:.2f}] over {r['rounds']}/{r['of_rounds']} rounds"
        lines.append(f"check {c.label} = {r['ratio']:.2f}x {spread_}  ({bound} {r['limit']}x)  {verdict}")
    return lines


def format_report(meta: dict, samples: dict[str, list[float]], result: dict, profile: list[str]) -> str:
    lines = [
        f"PDD runtime bench: {meta['model']}",
        (
            f"  {meta['dtype']} on {meta['device']}, {meta['threads']} threads, torch {meta['torch']}, "
            f"transformers {meta['transformers']}{', quick' if meta['quick'] else ''}; "
            f"load average {meta['load_avg_1m_at_start']} at start, {meta['load_avg_1m_at_end']} at end"
        ),
        "",
        *format_table(table_rows(samples, meta["plan"])),
        "",
        *format_checks(result),
    ]
    noisy = noisy_cases(samples)
    if noisy:
        lines += ["", f"warning: samples spread over {NOISY_SPREAD}x (machine noise?), consider a rerun:"]
        lines += [f"  {line}" for line in noisy]
    if profile:
        lines += ["", *profile]
    return "\n".join(lines)


# -- where a decode step's time goes ---------------------------------------------------------

CATEGORIES = (
    ("whole layers in C (layers.c: all of the below)", ("pdd::run_layers",)),
    ("projections (GEMM)", ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "pdd::skinny_linear")),
    (
        "attention matmuls, softmax",
        (
            "aten::bmm",
            "aten::baddbmm",
            "aten::_softmax",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "pdd::attend_rows",
        ),
    ),
    ("KV writes, gathers", ("aten::_index_put_impl_", "aten::index_select", "aten::index_copy_", "aten::index")),
)
OTHER = "other ops (norms, RoPE, silu, adds, copies)"
PYTHON = "Python and dispatch (wall - ops)"


def categorize(self_us: dict[str, float], wall_us: float) -> dict[str, float]:
    """Self CPU time per op name -> time per category, plus what no op accounts for."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    out[OTHER] = 0.0
    for op, us in self_us.items():
        name = next((n for n, ops in CATEGORIES if op in ops), OTHER)
        out[name] += us
    out[PYTHON] = max(wall_us - sum(self_us.values()), 0.0)
    return out


def format_profile(per_batch: dict[int, dict[str, float]]) -> list[str]:
    """Columns: batch sizes; rows: categories; cells: ms per step (share of the step)."""
    if not per_batch:
        return []
    batches = list(per_batch)
    names = list(next(iter(per_batch.values())))
    head = ["where a decode step's time goes (torch.profiler, ms per step, share)"]
    lines = [f"{'':<46}" + "".join(f"{'b=' + str(b):>16}" for b in batches)]
    for name in [*names, "total"]:
        cells = []
        for b in batches:
            cats = per_batch[b]
            total = sum(cats.values())
            ms = total if name == "total" else cats[name]
            cells.append(f"{ms / 1000:9.2f} ({100 * ms / total:3.0f}%)")
        lines.append(f"{name:<46}" + "".join(f"{c:>16}" for c in cells))
    note = "(profiling inflates small ops; compare shares across batch sizes, not to the table above)"
    return [*head, *lines, note]
