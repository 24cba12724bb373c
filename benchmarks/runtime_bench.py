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

Shared CPU machines stall for seconds at a time, so the cases of each phase run round-robin
(runtime b=1, b=4, ..., transformers b=1, then again): a stall slows every case alike instead of
one figure, and the ratios the checks use stay fair. A case whose samples spread more than 2x is
reported under the table; rerun when that happens.

Run it with `make bench-runtime`, or
    .venv/bin/python benchmarks/runtime_bench.py [--quick] [--threads N] [--model PATH]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--json FILE]
The table goes to stdout, progress to stderr. Times use `time.perf_counter` (with
`torch.cuda.synchronize` around each timed call on CUDA) and are medians of repeats.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, parse_dtype, resolve_device
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence

BLOCK_SIZE = 16
CHECK_BATCH_RATIO = 2.5  # (a) decode b=8 step < this x the b=1 step
CHECK_BASELINE_RATIO = 1.3  # (b) runtime b=1 step < this x the transformers step
NOISY_SPREAD = 2.0  # max / min of a case's samples above which the table warns


@dataclass(frozen=True)
class Plan:
    """What to measure and how often."""

    prefill_lens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 512
    extend_ks: tuple[int, ...] = (16, 64, 100)
    warmup: int = 2  # untimed rounds before the timed ones (prefill: always 1)
    decode_steps: int = 10  # timed decode rounds
    repeats: int = 3  # timed prefill / extend rounds

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup=1, decode_steps=4, repeats=1)

    def decode_capacity(self) -> int:
        """Tokens a decode sequence may reach: sequence 0 steps once per batch size per round."""
        return self.context + len(self.decode_batches) * (self.warmup + self.decode_steps) + 1

    def pool_tokens(self, block_size: int) -> int:
        """KV tokens the largest phase holds at once, each sequence rounded up to whole blocks."""

        def whole(n: int) -> int:
            return -(-n // block_size) * block_size

        decode = max(self.decode_batches) * whole(self.decode_capacity())
        return max(decode, whole(max(self.prefill_lens)), whole(self.context + max(self.extend_ks)))


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


def _noop() -> None:
    return None


@dataclass
class Case:
    """One timed call, and what to undo (untimed) before each call so every call does the same work."""

    run: Callable[[], object]
    reset: Callable[[], object] = _noop


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def interleaved(clock: Clock, cases: dict[str, Case], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Run the cases round-robin, `warmup` untimed rounds then `repeats` timed ones; ms per case."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + repeats):
        for name, case in cases.items():
            case.reset()
            ms = clock.ms(case.run)
            if i >= warmup:
                times[name].append(ms)
    return times


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- runtime side ---------------------------------------------------------------------------


def new_sequence(pool: KVPool, seq_id: str, tokens: list[int], capacity: int) -> Sequence:
    seq = Sequence(seq_id, list(tokens))
    seq.block_table = pool.allocator.allocate(pool.blocks_for(capacity))
    return seq


def release(pool: KVPool, seqs: list[Sequence]) -> None:
    for seq in seqs:
        pool.allocator.free(seq.block_table)
        seq.block_table = []


def rewind(seq: Sequence, tokens: list[int], computed: int, known: int) -> None:
    """Make `seq` know `tokens[:known]` with KV for the first `computed` (the rest is recomputed)."""
    seq.token_ids = tokens[:known]
    seq.num_computed = computed


def runtime_decode_step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """One decode step as the engine runs it: one token per sequence, then append the argmax."""
    result = runner.forward([(s, 1) for s in seqs])
    tokens = torch.argmax(result.logits, dim=-1).tolist()
    for seq, token in zip(seqs, tokens):
        seq.num_computed += 1
        seq.token_ids.append(token)


# -- plain transformers side ----------------------------------------------------------------


def new_cache(model: torch.nn.Module) -> object:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_forward(model: torch.nn.Module, ids: list[int], cache: object, device: torch.device) -> torch.Tensor:
    """One forward over `ids` on top of `cache`; returns the last row of logits."""
    kwargs = {cache_kwarg(model): cache}
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[0, -1]


def hf_prefill(model: torch.nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    return hf_forward(model, ids, new_cache(model), device)


def crop(cache: object, length: int) -> None:
    """Drop cached tokens past `length` (a negative crop means "remove this many")."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def hf_decoder(model: torch.nn.Module, tokens: list[int], device: torch.device) -> Callable[[], None]:
    """A decode step closure: cache prefilled with all but the last token, then one token per call."""
    cache = new_cache(model)
    hf_forward(model, tokens[:-1], cache, device)
    last = [tokens[-1]]

    def step() -> None:
        last[0] = int(torch.argmax(hf_forward(model, last, cache, device)))

    return step


# -- the phases ----------------------------------------------------------------------------


@dataclass
class Bench:
    runner: ModelRunner
    hf: torch.nn.Module
    clock: Clock
    plan: Plan
    device: torch.device
    samples: dict[str, list[float]] = field(default_factory=dict)  # raw ms per case, for the JSON

    @property
    def vocab(self) -> int:
        return self.hf.config.vocab_size

    def measure(self, cases: dict[str, Case], warmup: int, repeats: int) -> dict[str, float]:
        times = interleaved(self.clock, cases, warmup, repeats)
        self.samples.update(times)
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        for name, ms in medians.items():
            log(f"  {name:<28} {ms:9.2f} ms")
        return medians

    def prefill(self) -> tuple[dict[int, float], dict[int, float]]:
        """Prefill tok/s per prompt length, runtime then transformers; one sequence per forward."""
        log(f"prefill {self.plan.prefill_lens} tokens, 1 warmup + {self.plan.repeats} rounds")
        rt, tf = {}, {}
        for n in self.plan.prefill_lens:
            tokens = random_tokens(n, self.vocab, seed=n)
            seq = new_sequence(self.runner.pool, f"prefill-{n}", tokens, n)
            cases = {
                f"runtime prefill {n}": Case(
                    partial(self.runner.forward, [(seq, n)]), partial(rewind, seq, tokens, 0, n)
                ),
                f"transformers prefill {n}": Case(partial(hf_prefill, self.hf, tokens, self.device)),
            }
            ms = self.measure(cases, warmup=1, repeats=self.plan.repeats)
            release(self.runner.pool, [seq])
            rt[n] = n * 1000 / ms[f"runtime prefill {n}"]
            tf[n] = n * 1000 / ms[f"transformers prefill {n}"]
        return rt, tf

    def decode(self) -> tuple[dict[int, float], dict[int, float]]:
        """Decode step ms per batch size (runtime) and for one sequence (transformers), context ~512."""
        p, pool, batches = self.plan, self.runner.pool, self.plan.decode_batches
        seqs = []
        for i in range(max(p.decode_batches)):
            tokens = random_tokens(p.context, self.vocab, seed=1000 + i)
            seq = new_sequence(pool, f"decode-{i}", tokens, p.decode_capacity())
            self.runner.forward([(seq, p.context - 1)])
            rewind(seq, tokens, p.context - 1, p.context)
            seqs.append(seq)
        hf_step = hf_decoder(self.hf, random_tokens(p.context, self.vocab, seed=1000), self.device)
        log(f"decode: prefilled {len(seqs)} sequences of {p.context} tokens; {p.warmup} + {p.decode_steps} rounds")
        cases = {f"runtime decode b={b}": Case(partial(runtime_decode_step, self.runner, seqs[:b])) for b in batches}
        cases["transformers decode b=1"] = Case(hf_step)
        ms = self.measure(cases, p.warmup, p.decode_steps)
        release(pool, seqs)
        return {b: ms[f"runtime decode b={b}"] for b in batches}, {1: ms["transformers decode b=1"]}

    def extend(self) -> tuple[dict[int, float], dict[int, float]]:
        """ms to compute k known tokens on top of `context` tokens of cached KV, in one forward."""
        p = self.plan
        ctx, kmax = p.context, max(p.extend_ks)
        tokens = random_tokens(ctx + kmax, self.vocab, seed=7)
        seq = new_sequence(self.runner.pool, "extend", tokens[:ctx], ctx + kmax)
        self.runner.forward([(seq, ctx)])
        cache = new_cache(self.hf)
        hf_forward(self.hf, tokens[:ctx], cache, self.device)
        log(f"extend k={p.extend_ks} on {ctx} cached tokens; {p.warmup} + {p.repeats} rounds")
        rt, tf = {}, {}
        for k in p.extend_ks:
            rt_run = partial(self.runner.forward, [(seq, k)])
            tf_run = partial(hf_forward, self.hf, tokens[ctx : ctx + k], cache, self.device)
            cases = {
                f"runtime extend {k}": Case(rt_run, partial(rewind, seq, tokens, ctx, ctx + k)),
                f"transformers extend {k}": Case(tf_run, partial(crop, cache, ctx)),
            }
            ms = self.measure(cases, p.warmup, p.repeats)
            rt[k], tf[k] = ms[f"runtime extend {k}"], ms[f"transformers extend {k}"]
        release(self.runner.pool, [seq])
        return rt, tf


def build(path: Path, dtype: torch.dtype, device: torch.device, plan: Plan) -> Bench:
    from transformers import AutoModelForCausalLM

    log(f"loading {path} twice: runtime (paged attention) and plain transformers (sdpa)")
    model = load_model(path, dtype, str(device))
    tokens = plan.pool_tokens(BLOCK_SIZE)
    pool = KVPool.with_capacity(kv_layout(model), tokens=tokens, block_size=BLOCK_SIZE, dtype=dtype, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    return Bench(ModelRunner(model, pool), hf, Clock(device), plan, device)


def run_all(bench: Bench) -> dict:
    figures: dict[str, dict] = {"runtime": {}, "transformers": {}}
    with torch.inference_mode():
        phases = (("prefill_tok_s", bench.prefill), ("decode_ms", bench.decode), ("extend_ms", bench.extend))
        for name, phase in phases:
            figures["runtime"][name], figures["transformers"][name] = phase()
    return figures


# -- report ---------------------------------------------------------------------------------


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
    """(metric, runtime, transformers, runtime / transformers, note) per line of the table."""
    rows = []
    for n, v in rt["prefill_tok_s"].items():
        base = tf["prefill_tok_s"][n]
        note = f"{n * 1000 / v:.0f} ms vs {n * 1000 / base:.0f} ms"
        rows.append((f"prefill {n} tokens (tok/s)", f"{v:.0f}", f"{base:.0f}", f"{v / base:.2f}x", note))
    b1, tf1 = rt["decode_ms"][1], tf["decode_ms"][1]
    for b, v in rt["decode_ms"].items():
        base = tf["decode_ms"].get(b)
        cells = (f"{base:.2f}", f"{v / base:.2f}x") if base else ("-", "-")
        note = f"{v / b1:.2f}x b=1, {b * 1000 / v:.0f} tok/s"
        if b > 1:
            note += f"; tf one at a time {b * tf1:.0f} ms"
        rows.append((f"decode b={b} ctx~{ctx} (ms/step)", f"{v:.2f}", *cells, note))
    for k, v in rt["extend_ms"].items():
        base = tf["extend_ms"][k]
        note = f"{k * 1000 / v:.0f} tok/s"
        rows.append((f"extend k={k} on {ctx} (ms)", f"{v:.2f}", f"{base:.2f}", f"{v / base:.2f}x", note))
    return rows


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    header = ("metric", "runtime", "transformers", "rt/tf", "note")
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    align = [str.ljust, str.rjust, str.rjust, str.rjust, str.ljust]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(align[j](cell, widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("(rt/tf = runtime / transformers: above 1 is better for tok/s, worse for ms)")
    return lines


def noisy_cases(samples: dict[str, list[float]]) -> list[str]:
    """Cases whose slowest sample took more than NOISY_SPREAD x their fastest."""
    return [
        f"{name}: {min(ts):.1f}..{max(ts):.1f} ms"
        for name, ts in samples.items()
        if len(ts) > 1 and max(ts) > NOISY_SPREAD * min(ts)
    ]


def format_report(meta: dict, figures: dict, result: dict, samples: dict[str, list[float]]) -> str:
    rt, tf = figures["runtime"], figures["transformers"]
    lines = [
        f"PDD runtime bench: {meta['model']}",
        (
            f"  {meta['dtype']} on {meta['device']}, {meta['threads']} threads, torch {meta['torch']}, "
            f"transformers {meta['transformers']}{', quick' if meta['quick'] else ''}; "
            f"load average {meta['load_avg_1m_at_start']} at start"
        ),
        "",
        *format_table(table_rows(rt, tf, meta["plan"]["context"])),
        "",
    ]
    a, b = result["a_decode_b8_over_b1"], result["b_decode_b1_runtime_over_transformers"]
    verdict = {True: "PASS", False: "FAIL"}
    for label, c in (("(a) runtime decode b=8 / b=1 step  ", a), ("(b) runtime / transformers b=1 step", b)):
        lines.append(f"check {label} = {c['ratio']:.2f}x  (< {c['limit']}x)  {verdict[c['passed']]}")
    noisy = noisy_cases(samples)
    if noisy:
        lines += ["", f"warning: samples spread over {NOISY_SPREAD}x (machine noise?), consider a rerun:"]
        lines += [f"  {line}" for line in noisy]
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


def metadata(args: argparse.Namespace, device: torch.device, plan: Plan) -> dict:
    import transformers

    return {
        "model": str(args.model),
        "device": str(device),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quick": args.quick,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "plan": asdict(plan),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from shared.runtime.provision import provision_default_model

        args.model = provision_default_model(log=log)
    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    plan = Plan.quick() if args.quick else Plan()
    meta = metadata(args, device, plan)
    bench = build(args.model, dtype, device, plan)
    figures = run_all(bench)
    result = checks(figures["runtime"], figures["transformers"])
    print(format_report(meta, figures, result, bench.samples))
    if args.json:
        payload = {"meta": meta, **figures, "checks": result, "samples_ms": bench.samples}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
