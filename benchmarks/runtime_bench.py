"""Runtime figures: the paged runtime against plain transformers, same model, same run.

What it measures (SmolLM2-135M by default, float32, CPU, 2 threads unless told otherwise):

runtime (`ModelRunner.forward` on a `KVPool`, exactly what the engine runs per step; on CPU the
default, batch-invariant kernels: benchmarks/kernels_bench.py sets them beside the fastest path)
  - prefill tok/s at 512 and 2048 prompt tokens: one sequence, the whole prompt as one span;
  - decode step ms at batch 1, 4, 8, 16, context ~512: every sequence is prefilled first, then
    each step computes one token per sequence and appends the argmax, like `Engine.step`
    (2 warmup steps, median of 10);
  - extend ms for k = 16, 64, 100: k known tokens on top of 512 tokens of cached KV, one forward.

plain transformers (same folder, `attn_implementation="sdpa"`, `DynamicCache`, one sequence)
  - prefill tok/s at 512 / 2048, single-sequence decode step ms at context ~512, extend of k
    tokens on top of a 512-token cache. Calls pass `logits_to_keep=1`, as `generate()` does, so
    neither side pays for LM-head rows it throws away.

Then it prints the checks the project must meet (benchmarks/runtime_report.py):
  (a) runtime decode of 8 sequences costs <= 1.6x the runtime's batch-1 step;
  (b) runtime decode of 16 sequences costs <= 2.2x the runtime's batch-1 step;
  (c) runtime single-sequence decode step is within 1.05x of plain transformers' step;
  (d, e) runtime prefill of 512 and 2048 tokens at least as fast as plain transformers.

Shared CPU machines stall for seconds at a time, so the cases of each phase run round-robin
(runtime b=1, b=4, ..., transformers b=1, then again): a stall slows every case of a round alike,
and each check is the median over rounds of the per-round ratio, printed with its min..max (rounds
where one side stalled are left out; see runtime_report.py). Each timed round first waits, up to
`--quiet-wait` seconds (default 30), until no other process keeps the CPUs busy. Every figure is
printed as median [min..max]; a case whose samples spread more than 1.5x is listed under the
table; rerun when that happens. `--profile` adds where a decode step's time goes at
batch 1, 8 and 16 (torch.profiler, by category).

Run it with `make bench-runtime`, or
    .venv/bin/python benchmarks/runtime_bench.py [--quick] [--threads N] [--model PATH]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--json FILE] [--profile] [--quiet-wait S]
The table goes to stdout, progress to stderr. Times use `time.perf_counter` (with
`torch.cuda.synchronize` around each timed call on CUDA) and are medians of repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import runtime_report as report
from benchmarks.runtime_common import (  # noqa: F401  (new_sequence ... runtime_decode_step: sim/measure.py)
    Case,
    Clock,
    crop,
    hf_decoder,
    hf_forward,
    hf_prefill,
    interleaved,
    log,
    new_cache,
    new_sequence,
    random_tokens,
    release,
    rewind,
    runtime_decode_step,
)
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, parse_dtype, resolve_device
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence

BLOCK_SIZE = 16
PROFILE_BATCHES = (1, 8, 16)


@dataclass(frozen=True)
class Plan:
    """What to measure and how often."""

    prefill_lens: tuple[int, ...] = (512, 2048)
    decode_batches: tuple[int, ...] = (1, 4, 8, 16)
    context: int = 512
    extend_ks: tuple[int, ...] = (16, 64, 100)
    warmup: int = 2  # untimed rounds before the timed ones (prefill: always 1)
    decode_steps: int = 20  # timed decode rounds
    repeats: int = 5  # timed prefill / extend rounds
    quiet_wait_s: float = 30.0  # a timed round waits up to this long for other processes to go quiet

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup=1, decode_steps=4, repeats=1, quiet_wait_s=0.0)

    def decode_capacity(self) -> int:
        """Tokens a decode sequence may reach: sequence 0 steps once per batch size per round."""
        return self.context + len(self.decode_batches) * (self.warmup + self.decode_steps) + 1

    def pool_tokens(self, block_size: int) -> int:
        """KV tokens the largest phase holds at once, each sequence rounded up to whole blocks."""

        def whole(n: int) -> int:
            return -(-n // block_size) * block_size

        decode = max(self.decode_batches) * whole(self.decode_capacity())
        return max(decode, whole(max(self.prefill_lens)), whole(self.context + max(self.extend_ks)))


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
        times = interleaved(self.clock, cases, warmup, repeats, self.plan.quiet_wait_s)
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

    def decode_sequences(self, n: int) -> list[Sequence]:
        """n sequences of `context` known tokens with KV for all but the last (one decode away)."""
        p, seqs = self.plan, []
        for i in range(n):
            tokens = random_tokens(p.context, self.vocab, seed=1000 + i)
            seq = new_sequence(self.runner.pool, f"decode-{i}", tokens, p.decode_capacity())
            self.runner.forward([(seq, p.context - 1)])
            rewind(seq, tokens, p.context - 1, p.context)
            seqs.append(seq)
        return seqs

    def decode(self) -> tuple[dict[int, float], dict[int, float]]:
        """Decode step ms per batch size (runtime) and for one sequence (transformers), context ~512."""
        p, batches = self.plan, self.plan.decode_batches
        seqs = self.decode_sequences(max(batches))
        hf_step = hf_decoder(self.hf, random_tokens(p.context, self.vocab, seed=1000), self.device)
        log(f"decode: prefilled {len(seqs)} sequences of {p.context} tokens; {p.warmup} + {p.decode_steps} rounds")
        cases = {f"runtime decode b={b}": Case(partial(runtime_decode_step, self.runner, seqs[:b])) for b in batches}
        cases["transformers decode b=1"] = Case(hf_step)
        ms = self.measure(cases, p.warmup, p.decode_steps)
        release(self.runner.pool, seqs)
        return {b: ms[f"runtime decode b={b}"] for b in batches}, {1: ms["transformers decode b=1"]}

    def profile(self, steps: int = 5) -> dict[int, dict[str, float]]:
        """Self CPU time per category of `steps` decode steps at each of PROFILE_BATCHES, us per step."""
        from torch.profiler import ProfilerActivity, profile

        seqs = self.decode_sequences(max(PROFILE_BATCHES))
        out = {}
        for b in PROFILE_BATCHES:
            for _ in range(2):
                runtime_decode_step(self.runner, seqs[:b])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    runtime_decode_step(self.runner, seqs[:b])
                wall_us = (time.perf_counter() - t0) * 1e6
            self_us = {e.key: e.self_cpu_time_total / steps for e in prof.key_averages()}
            out[b] = report.categorize(self_us, wall_us / steps)
        release(self.runner.pool, seqs)
        return out

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", type=Path, default=None, help="HF model folder (default: the provisioned SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="fewer repeats, for a smoke run")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--profile", action="store_true", help="also profile decode steps at batch 1, 8, 16")
    p.add_argument("--quiet-wait", type=float, default=None, metavar="S", help="max wait for quiet per round (0: off)")
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
    if args.quiet_wait is not None:
        plan = replace(plan, quiet_wait_s=args.quiet_wait)
    meta = metadata(args, device, plan)
    bench = build(args.model, dtype, device, plan)
    figures = run_all(bench)
    profile = bench.profile() if args.profile else {}
    meta["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    result = report.checks(bench.samples)
    print(report.format_report(meta, bench.samples, result, report.format_profile(profile)))
    if args.json:
        payload = {"meta": meta, **figures, "checks": result, "samples_ms": bench.samples, "profile_us": profile}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
