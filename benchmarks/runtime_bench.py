"""Runtime figures: the paged runtime against plain transformers, same model, same run.

What it measures (SmolLM2-135M by default, float32, CPU, 2 threads unless told otherwise):

runtime (`ModelRunner.forward` on a `KVPool`, exactly what the engine runs per step)
  - prefill tok/s at 512 and 2048 prompt tokens: one sequence, the whole prompt as one span;
  - decode step ms at batch 1, 4, 8, 16, context ~512: every sequence is prefilled first, then
    each step computes one token per sequence and appends the argmax, like `Engine.step`
    (2 warmup steps, median of 10);
  - extend ms for k = 16, 64, 100: k known tokens on top of 512 tokens of cached KV, one forward.

plain transformers (same folder, `attn_implementation="sdpa"`, `DynamicCache`, one sequence)
  - prefill tok/s at 512 / 2048, single-sequence decode step ms at context ~512, extend of k
    tokens on top of a 512-token cache. Calls pass `logits_to_keep=1`, as `generate()` does, so
    neither side pays for LM-head rows it throws away.

Then it prints the two checks the project must meet:
  (a) runtime decode of 8 sequences costs < 2.5x the runtime's batch-1 step;
  (b) runtime single-sequence decode step is within 1.3x of plain transformers' step.

Run it with `make bench-runtime`, or
    .venv/bin/python benchmarks/runtime_bench.py [--quick] [--threads N] [--model PATH]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--json FILE]
The table goes to stdout, progress to stderr. Times use `time.perf_counter` (with
`torch.cuda.synchronize` around each timed call on CUDA) and are medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shared.runtime.kv_pool import KVPool  # noqa: E402
from shared.runtime.models import kv_layout, load_model, parse_dtype, resolve_device  # noqa: E402
from shared.runtime.runner import ModelRunner  # noqa: E402
from shared.runtime.sequence import Sequence  # noqa: E402

CHECK_BATCH_RATIO = 2.5  # (a) decode b=8 step < this x the b=1 step
CHECK_BASELINE_RATIO = 1.3  # (b) runtime b=1 step < this x the transformers step


@dataclass(frozen=True)
class Plan:
    """What to measure and how often."""

    prefill_lens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 512
    extend_ks: tuple[int, ...] = (16, 64, 100)
    warmup: int = 2  # untimed calls before each timed series
    decode_steps: int = 10  # timed decode steps per batch size
    repeats: int = 3  # timed prefill / extend calls per figure

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup=1, decode_steps=4, repeats=1)

    def pool_tokens(self) -> int:
        per_decode_seq = self.context + self.warmup + self.decode_steps + 1
        per_extend_seq = self.context + max(self.extend_ks)
        return max(max(self.decode_batches) * per_decode_seq, max(self.prefill_lens), per_extend_seq)


class Clock:
    """Wall-clock timing of one call, synchronising the GPU on both sides when there is one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1000


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def repeat_ms(
    clock: Clock, fn: Callable[[], object], reset: Callable[[], object], warmup: int, repeats: int
) -> float:
    """Median ms of `repeats` calls of `fn` after `warmup` untimed ones; `reset` runs untimed before each."""
    times = []
    for i in range(warmup + repeats):
        reset()
        t = clock.ms(fn)
        if i >= warmup:
            times.append(t)
    return statistics.median(times)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- runtime ------------------------------------------------------------------------------


def new_sequence(pool: KVPool, seq_id: str, tokens: list[int], capacity: int) -> Sequence:
    seq = Sequence(seq_id, list(tokens))
    seq.block_table = pool.allocator.allocate(pool.blocks_for(capacity))
    return seq


def release(pool: KVPool, seqs: list[Sequence]) -> None:
    for seq in seqs:
        pool.allocator.free(seq.block_table)
        seq.block_table = []


def runtime_prefill(runner: ModelRunner, clock: Clock, plan: Plan, vocab: int) -> dict[int, float]:
    """Prefill tok/s per prompt length: the whole prompt as one span of one forward."""
    out: dict[int, float] = {}
    for n in plan.prefill_lens:
        seq = new_sequence(runner.pool, f"prefill-{n}", random_tokens(n, vocab, seed=n), n)

        def reset() -> None:
            seq.num_computed = 0

        ms = repeat_ms(clock, lambda: runner.forward([(seq, n)]), reset, 1, plan.repeats)
        release(runner.pool, [seq])
        out[n] = n / (ms / 1000)
        log(f"runtime prefill {n:>5} tokens: {ms:8.1f} ms  ({out[n]:.0f} tok/s)")
    return out


def runtime_decode_step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """One decode step as the engine runs it: one token per sequence, then append the argmax."""
    result = runner.forward([(s, 1) for s in seqs])
    tokens = torch.argmax(result.logits, dim=-1).tolist()
    for seq, token in zip(seqs, tokens):
        seq.num_computed += 1
        seq.token_ids.append(token)


def runtime_decode(runner: ModelRunner, clock: Clock, plan: Plan, vocab: int) -> dict[int, float]:
    """Median decode step ms per batch size. Sequences are prefilled to context - 1 once, then
    rewound to that point before each batch size, so every batch starts at the same context."""
    ctx, capacity = plan.context, plan.context + plan.warmup + plan.decode_steps + 1
    seqs = []
    for i in range(max(plan.decode_batches)):
        seq = new_sequence(runner.pool, f"decode-{i}", random_tokens(ctx, vocab, seed=1000 + i), capacity)
        runner.forward([(seq, ctx - 1)])
        seq.num_computed = ctx - 1
        seqs.append(seq)
    log(f"runtime decode: prefilled {len(seqs)} sequences of {ctx} tokens")
    out: dict[int, float] = {}
    for batch in plan.decode_batches:
        group = seqs[:batch]
        for seq in group:
            del seq.token_ids[ctx:]
            seq.num_computed = ctx - 1
        times = [clock.ms(lambda: runtime_decode_step(runner, group)) for _ in range(plan.warmup + plan.decode_steps)]
        out[batch] = statistics.median(times[plan.warmup :])
        log(f"runtime decode batch {batch:>2}: {out[batch]:8.2f} ms/step")
    release(runner.pool, seqs)
    return out


def runtime_extend(runner: ModelRunner, clock: Clock, plan: Plan, vocab: int) -> dict[int, float]:
    """Median ms to compute k known tokens on top of `context` tokens of cached KV, one forward."""
    ctx, kmax = plan.context, max(plan.extend_ks)
    tokens = random_tokens(ctx + kmax, vocab, seed=7)
    seq = new_sequence(runner.pool, "extend", tokens[:ctx], ctx + kmax)
    runner.forward([(seq, ctx)])
    out: dict[int, float] = {}
    for k in plan.extend_ks:

        def reset(k: int = k) -> None:
            seq.token_ids = tokens[: ctx + k]
            seq.num_computed = ctx

        out[k] = repeat_ms(clock, lambda k=k: runner.forward([(seq, k)]), reset, plan.warmup, plan.repeats)
        log(f"runtime extend k={k:>3} on {ctx}: {out[k]:8.2f} ms")
    release(runner.pool, [seq])
    return out


def bench_runtime(path: Path, dtype: torch.dtype, device: torch.device, plan: Plan, clock: Clock) -> dict:
    log(f"loading runtime model from {path}")
    model = load_model(path, dtype, str(device))
    pool = KVPool.with_capacity(kv_layout(model), tokens=plan.pool_tokens() + 64, dtype=dtype, device=device)
    runner = ModelRunner(model, pool)
    vocab = model.config.vocab_size
    figures = {
        "prefill_tok_s": runtime_prefill(runner, clock, plan, vocab),
        "decode_ms": runtime_decode(runner, clock, plan, vocab),
        "extend_ms": runtime_extend(runner, clock, plan, vocab),
    }
    del runner, pool, model
    return figures


# -- plain transformers -------------------------------------------------------------------


def hf_forward(model: torch.nn.Module, ids: list[int], cache: object, device: torch.device) -> torch.Tensor:
    """One forward over `ids` on top of `cache`; returns the last row of logits."""
    out = model(
        input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1
    )
    return out.logits[0, -1]


def hf_prefill(model: torch.nn.Module, clock: Clock, plan: Plan, device: torch.device) -> dict[int, float]:
    from transformers import DynamicCache

    out: dict[int, float] = {}
    for n in plan.prefill_lens:
        ids = random_tokens(n, model.config.vocab_size, seed=n)
        run = lambda ids=ids: hf_forward(model, ids, DynamicCache(config=model.config), device)  # noqa: E731
        ms = repeat_ms(clock, run, lambda: None, 1, plan.repeats)
        out[n] = n / (ms / 1000)
        log(f"transformers prefill {n:>5} tokens: {ms:8.1f} ms  ({out[n]:.0f} tok/s)")
    return out


def hf_decode(model: torch.nn.Module, clock: Clock, plan: Plan, device: torch.device) -> dict[int, float]:
    """Single-sequence decode step ms at context ~`plan.context` (same start as the runtime)."""
    from transformers import DynamicCache

    ids = random_tokens(plan.context, model.config.vocab_size, seed=1000)
    cache = DynamicCache(config=model.config)
    hf_forward(model, ids[:-1], cache, device)
    last = [ids[-1]]

    def step() -> None:
        last[0] = int(torch.argmax(hf_forward(model, last, cache, device)))

    times = [clock.ms(step) for _ in range(plan.warmup + plan.decode_steps)]
    ms = statistics.median(times[plan.warmup :])
    log(f"transformers decode batch  1: {ms:8.2f} ms/step")
    return {1: ms}


def hf_extend(model: torch.nn.Module, clock: Clock, plan: Plan, device: torch.device) -> dict[int, float]:
    from transformers import DynamicCache

    ctx, kmax = plan.context, max(plan.extend_ks)
    tokens = random_tokens(ctx + kmax, model.config.vocab_size, seed=7)
    cache = DynamicCache(config=model.config)
    hf_forward(model, tokens[:ctx], cache, device)
    out: dict[int, float] = {}
    for k in plan.extend_ks:
        run = lambda k=k: hf_forward(model, tokens[ctx : ctx + k], cache, device)  # noqa: E731
        out[k] = repeat_ms(clock, run, lambda: cache.crop(ctx), plan.warmup, plan.repeats)
        log(f"transformers extend k={k:>3} on {ctx}: {out[k]:8.2f} ms")
    return out


def bench_transformers(path: Path, dtype: torch.dtype, device: torch.device, plan: Plan, clock: Clock) -> dict:
    from transformers import AutoModelForCausalLM

    log(f"loading plain transformers model (sdpa) from {path}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    with torch.inference_mode():
        figures = {
            "prefill_tok_s": hf_prefill(model, clock, plan, device),
            "decode_ms": hf_decode(model, clock, plan, device),
            "extend_ms": hf_extend(model, clock, plan, device),
        }
    del model
    return figures


# -- report -------------------------------------------------------------------------------


def checks(rt: dict, tf: dict) -> dict:
    batch_ratio = rt["decode_ms"][8] / rt["decode_ms"][1]
    baseline_ratio = rt["decode_ms"][1] / tf["decode_ms"][1]
    return {
        "a_decode_b8_over_b1": {
            "ratio": batch_ratio,
            "limit": CHECK_BATCH_RATIO,
            "passed": batch_ratio < CHECK_BATCH_RATIO,
        },
        "b_decode_b1_runtime_over_transformers": {
            "ratio": baseline_ratio,
            "limit": CHECK_BASELINE_RATIO,
            "passed": baseline_ratio < CHECK_BASELINE_RATIO,
        },
    }


def table_rows(rt: dict, tf: dict, ctx: int) -> list[tuple[str, str, str, str, str]]:
    """(metric, runtime, transformers, runtime vs transformers, note) per line of the table."""
    rows = []
    for n, v in rt["prefill_tok_s"].items():
        base = tf["prefill_tok_s"].get(n)
        rows.append((f"prefill {n} tokens (tok/s)", f"{v:.0f}", f"{base:.0f}", f"{v / base:.2f}x", "higher is better"))
    b1 = rt["decode_ms"][1]
    for b, v in rt["decode_ms"].items():
        base = tf["decode_ms"].get(b)
        vs = f"{v / base:.2f}x" if base else "-"
        note = f"{v / b1:.2f}x b=1 step, {b * 1000 / v:.0f} tok/s"
        rows.append((f"decode b={b} ctx~{ctx} (ms/step)", f"{v:.2f}", f"{base:.2f}" if base else "-", vs, note))
    for k, v in rt["extend_ms"].items():
        base = tf["extend_ms"][k]
        rows.append((f"extend k={k} on {ctx} (ms)", f"{v:.2f}", f"{base:.2f}", f"{v / base:.2f}x", f"{k * 1000 / v:.0f} tok/s"))
    return rows


def format_report(meta: dict, rt: dict, tf: dict, result: dict, ctx: int) -> str:
    header = ("metric", "runtime", "transformers", "rt/tf", "note")
    rows = [header, *table_rows(rt, tf, ctx)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    align = [str.ljust, str.rjust, str.rjust, str.rjust, str.ljust]
    lines = [
        f"PDD runtime bench: {meta['model']}",
        f"  {meta['dtype']} on {meta['device']}, {meta['threads']} threads, torch {meta['torch']}, "
        f"transformers {meta['transformers']}{', quick' if meta['quick'] else ''}",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(align[j](cell, widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    a, b = result["a_decode_b8_over_b1"], result["b_decode_b1_runtime_over_transformers"]
    verdict = {True: "PASS", False: "FAIL"}
    lines += [
        "",
        f"check (a) runtime decode b=8 / b=1 step      = {a['ratio']:.2f}x  (< {a['limit']}x)  {verdict[a['passed']]}",
        f"check (b) runtime / transformers b=1 step    = {b['ratio']:.2f}x  (< {b['limit']}x)  {verdict[b['passed']]}",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: the provisioned SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from shared.runtime.provision import provision_default_model

        args.model = provision_default_model(log=log)
    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    plan = Plan.quick() if args.quick else Plan()
    clock = Clock(device)
    rt = bench_runtime(args.model, dtype, device, plan, clock)
    tf = bench_transformers(args.model, dtype, device, plan, clock)
    result = checks(rt, tf)
    import transformers

    meta = {
        "model": str(args.model),
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quick": args.quick,
        "plan": plan.__dict__,
    }
    print(format_report(meta, rt, tf, result, plan.context))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runtime": rt, "transformers": tf, "checks": result}, indent=2))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
