"""The batch-invariant kernels' cost, float32 and bfloat16, against the fastest non-invariant path.

Four runners over the same model folder, measured round-robin in one process (so a stall of the
machine slows them alike): {float32, bfloat16} x {invariant (skinny.c + rows.c, the CPU default),
fastest (`invariant=False`: oneDNN/MKL timed per model, the decode mirror, SDPA)}. Per runner:
decode step ms at batch 1 and 8, context ~512; prefill ms at 512 and 2048 tokens. Ratios are
medians of per-round ratios, with their min..max.

Checks (issue "the same answer whatever the route"):
  (f) bfloat16 invariant decode b=1 <= 0.6x the float32 step (the fastest float32 path's);
  (g) bfloat16 invariant decode b=8 <= 1.5x its b=1;
  (h) invariant prefill (the shipped prefill precision, float32) not slower than the fastest's.

`--python-loop` adds the invariant kernels run through fused.py's Python layer loop instead of
layers.c's one call per step, and the ratio of the two per case.

Run by `make bench-runtime` after the runtime figures, or alone:
    .venv/bin/python benchmarks/kernels_bench.py [--quick] [--python-loop] [--threads N] [--model PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.runtime_common import (
    Case,
    Clock,
    interleaved,
    log,
    new_sequence,
    random_tokens,
    release,
    rewind,
    runtime_decode_step,
)
from benchmarks.runtime_report import paired, spread
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model
from shared.runtime.runner import ModelRunner

BLOCK = 16
KINDS = [("float32", True), ("float32", False), ("bfloat16", True), ("bfloat16", False)]
LOOP = "invariant, Python loop"  # the invariant kernels without layers.c: fused.py's own layer loop


@dataclass(frozen=True)
class Plan:
    context: int = 512
    batches: tuple[int, ...] = (1, 8)
    prefill_lens: tuple[int, ...] = (512, 2048)
    warmup: int = 2
    decode_rounds: int = 12
    prefill_rounds: int = 3
    python_loop: bool = False  # also the invariant kernels through fused.py's Python layer loop

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup=1, decode_rounds=3, prefill_rounds=1)


def name(dtype: str, invariant: bool) -> str:
    return f"{dtype} {'invariant' if invariant else 'fastest'}"


def runners(path: Path, plan: Plan) -> dict[str, ModelRunner]:
    out = {}
    tokens = max(plan.batches) * (plan.context + 64 * (plan.warmup + plan.decode_rounds)) + max(plan.prefill_lens)
    for dtype, invariant in KINDS:
        model = load_model(path, dtype)
        pool = KVPool.with_capacity(kv_layout(model), tokens=tokens, block_size=BLOCK, dtype=model.dtype)
        runner = ModelRunner(model, pool, invariant=invariant)
        out[name(dtype, invariant)] = runner
        log(f"{name(dtype, invariant)}: projections on {runner.decoder.kernel} ({runner.decoder.kernel_note})")
        if invariant:
            log(f"{name(dtype, invariant)}: layers.c {runner.decoder.c_layers_note or 'runs the layer stack'}")
    if plan.python_loop:
        for dtype in ("float32", "bfloat16"):
            model = load_model(path, dtype)  # its own decoder: the C stack is taken off it alone
            pool = KVPool.with_capacity(kv_layout(model), tokens=tokens, block_size=BLOCK, dtype=model.dtype)
            runner = ModelRunner(model, pool, invariant=True)
            runner.decoder.c_layers = None
            out[f"{dtype} {LOOP}"] = runner
    return out


def measure(path: Path, plan: Plan) -> dict[str, list[float]]:
    """Raw ms per case (one list per case, one sample per round, rounds aligned across cases)."""
    rs = runners(path, plan)
    vocab = next(iter(rs.values())).model.config.vocab_size
    clock, samples = Clock(torch.device("cpu")), {}
    decode_cases, held = {}, []
    for key, runner in rs.items():
        seqs = []
        for i in range(max(plan.batches)):
            tokens = random_tokens(plan.context, vocab, seed=1000 + i)
            capacity = plan.context + len(plan.batches) * (plan.warmup + plan.decode_rounds) + 1
            seq = new_sequence(runner.pool, f"d{i}", tokens, capacity)
            runner.forward([(seq, plan.context - 1)])
            rewind(seq, tokens, plan.context - 1, plan.context)
            seqs.append(seq)
        held.append((key, runner, seqs))
    for b in plan.batches:  # by batch, then runner: every step follows another model's step (a
        # cold cache for each alike; runner by runner, b=8 found the weights b=1 had just read)
        for key, runner, seqs in held:
            decode_cases[f"{key} decode b={b}"] = Case(partial(runtime_decode_step, runner, seqs[:b]))
    log(f"decode b={plan.batches}, context {plan.context}: {plan.warmup} + {plan.decode_rounds} rounds")
    samples |= interleaved(clock, decode_cases, plan.warmup, plan.decode_rounds)
    for _, runner, seqs in held:
        release(runner.pool, seqs)
    for n in plan.prefill_lens:
        tokens = random_tokens(n, vocab, seed=n)
        cases, seqs = {}, []
        for key, runner in rs.items():
            seq = new_sequence(runner.pool, f"p{n}", tokens, n)
            seqs.append((runner, seq))
            cases[f"{key} prefill {n}"] = Case(partial(runner.forward, [(seq, n)]), partial(rewind, seq, tokens, 0, n))
        log(f"prefill {n}: 1 + {plan.prefill_rounds} rounds")
        samples |= interleaved(clock, cases, 1, plan.prefill_rounds)
        for runner, seq in seqs:
            release(runner.pool, [seq])
    return samples


def ratio(samples: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of samples[num] / samples[den]."""
    rs = paired(samples, num, den)
    return statistics.median(rs), min(rs), max(rs)


def report(samples: dict[str, list[float]], plan: Plan) -> str:
    lines = ["", "## batch-invariant kernels (ms, median [min..max] over rounds)", ""]
    cases = [f"decode b={b}" for b in plan.batches] + [f"prefill {n}" for n in plan.prefill_lens]
    lines.append("| case | " + " | ".join(name(d, i) for d, i in KINDS) + " | invariant / fastest, fp32 | bf16 |")
    lines.append("|" + " --- |" * (len(KINDS) + 3))
    for case in cases:
        cells = [spread(samples[f"{name(d, i)} {case}"]) for d, i in KINDS]
        costs = [ratio(samples, f"{name(d, True)} {case}", f"{name(d, False)} {case}") for d in ("float32", "bfloat16")]
        cells += [f"{m:.2f}x [{lo:.2f}..{hi:.2f}]" for m, lo, hi in costs]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    if plan.python_loop:
        lines += ["", "| case | layers.c / Python loop, fp32 | bf16 |", "| --- | --- | --- |"]
        for case in cases:
            costs = [ratio(samples, f"{name(d, True)} {case}", f"{d} {LOOP} {case}") for d in ("float32", "bfloat16")]
            loops = [spread(samples[f"{d} {LOOP} {case}"]) for d in ("float32", "bfloat16")]
            cells = [f"{m:.2f}x [{lo:.2f}..{hi:.2f}] (loop {ms})" for (m, lo, hi), ms in zip(costs, loops)]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    b1, b8 = plan.batches[0], plan.batches[-1]
    checks = [
        ("(f) bf16 invariant decode b=1 / fp32 fastest b=1", "<= 0.60x",
         ratio(samples, f"bfloat16 invariant decode b={b1}", f"float32 fastest decode b={b1}"), 0.60),
        ("    bf16 invariant decode b=1 / fp32 invariant b=1", "(shown)",
         ratio(samples, f"bfloat16 invariant decode b={b1}", f"float32 invariant decode b={b1}"), None),
        (f"(g) bf16 invariant decode b={b8} / b={b1}", "<= 1.50x",
         ratio(samples, f"bfloat16 invariant decode b={b8}", f"bfloat16 invariant decode b={b1}"), 1.50),
    ]  # fmt: skip
    for n in plan.prefill_lens:
        checks.append(
            (f"(h) fp32 invariant prefill {n} / fastest", "<= 1.00x",
             ratio(samples, f"float32 invariant prefill {n}", f"float32 fastest prefill {n}"), 1.00)
        )  # fmt: skip
    lines += ["", "| check | target | measured | |", "| --- | --- | --- | --- |"]
    for label, target, (m, lo, hi), bound in checks:
        verdict = "" if bound is None else ("ok" if m <= bound else "FAIL")
        lines.append(f"| {label} | {target} | {m:.2f}x [{lo:.2f}..{hi:.2f}] | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: the provisioned SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="fewer rounds, for a smoke run")
    p.add_argument("--python-loop", action="store_true", help="also time the kernels through the Python layer loop")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from shared.runtime.provision import provision_default_model

        args.model = provision_default_model(log=log)
    plan = dataclasses.replace(Plan.quick() if args.quick else Plan(), python_loop=args.python_loop)
    with torch.inference_mode():
        samples = measure(args.model, plan)
    print(report(samples, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
