"""Runtime figures on one GPU, as JSON: the second half of benchmarks/gpu_check.sh.

For each model — the provisioned SmolLM2-135M and a random Llama-3-8B-shaped model built from a
config on the device (no download) — in bfloat16 on a GPU (float32 on CPU):
- decode step ms at batch 1, 8, 32, context ~512: eager, and replayed from CUDA graphs;
- plain transformers' decode step at batch 1 (same weights, sdpa, DynamicCache), for reference;
- prefill tok/s of one sequence of 512 and 2048 tokens;
- extend of 100 known tokens on 512 cached ones, ms;
- KV export / import of 2048 tokens, GB/s: the pool's whole-range transfer (one gather, one copy
  through pinned memory) and kv_payload's per-layer export, for comparison.
Every ms figure is {median, min, max, n}; the cases of a phase run round-robin.

`--quick` (with `--device cpu`: the CPU smoke run of the test suite) shrinks the 8B shape to two
small layers and the contexts to 64 tokens, and repeats little: it checks the plumbing and the
output format, not the figures. On CPU "graphs" is the same static-bucket step run eagerly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.runtime_common import (  # noqa: E402
    Case,
    Clock,
    hf_decoder,
    interleaved,
    log,
    new_sequence,
    random_tokens,
    release,
    rewind,
    runtime_decode_step,
)
from shared.runtime.attention import ATTN_IMPLEMENTATION  # noqa: E402
from shared.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from shared.runtime.kv_payload import export_kv  # noqa: E402
from shared.runtime.kv_pool import KVPool  # noqa: E402
from shared.runtime.models import kv_layout, load_model, set_attention  # noqa: E402
from shared.runtime.runner import ModelRunner  # noqa: E402

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
QUICK_SHAPE = dict(LLAMA3_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2)


@dataclass(frozen=True)
class Plan:
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 512
    prefill_lens: tuple[int, ...] = (512, 2048)
    extend: int = 100
    kv_tokens: int = 2048
    warmup: int = 3
    steps: int = 20
    repeats: int = 5

    @classmethod
    def quick(cls) -> Plan:
        return cls(context=64, prefill_lens=(64, 128), kv_tokens=128, warmup=1, steps=3, repeats=2)

    def decode_capacity(self) -> int:
        """Tokens a decode sequence may reach: sequence 0 steps in every case of every round."""
        return self.context + 2 * len(self.batches) * (self.warmup + self.steps) + 1

    def pool_tokens(self) -> int:
        """The largest phase's KV (phases release theirs), each sequence rounded up to whole blocks."""
        decode = max(self.batches) * (self.decode_capacity() + 16)
        return max(decode, sum(self.prefill_lens) + self.context + self.extend + 48, self.kv_tokens + 16)


def stats(ts: list[float]) -> dict:
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": len(ts)}


def build_model(name: str, device: torch.device, dtype: torch.dtype, quick: bool) -> torch.nn.Module:
    if name == "smollm2":
        from shared.runtime.provision import provision_default_model

        return load_model(provision_default_model(log=log), dtype, str(device))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(QUICK_SHAPE if quick else LLAMA3_8B))
    config._attn_implementation = ATTN_IMPLEMENTATION
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: seconds, not minutes, for 8B
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


class Figures:
    def __init__(self, model: torch.nn.Module, device: torch.device, plan: Plan) -> None:
        self.model, self.device, self.plan = model, device, plan
        dtype = next(model.parameters()).dtype
        self.pool = KVPool.with_capacity(kv_layout(model), tokens=plan.pool_tokens(), dtype=dtype, device=device)
        self.eager = ModelRunner(model, self.pool, cuda_graphs=False)
        self.graphed = ModelRunner(model, self.pool, cuda_graphs=device.type == "cuda")
        if self.graphed.graphs is None:
            self.graphed.graphs = DecodeGraphs(self.graphed.decoder, self.graphed.pool, capture=False)
        self.clock = Clock(device)
        self.vocab = model.config.vocab_size

    def decode(self) -> dict:
        p = self.plan
        seqs = []
        for i in range(max(p.batches)):
            tokens = random_tokens(p.context, self.vocab, seed=100 + i)
            seq = new_sequence(self.pool, f"d{i}", tokens, p.decode_capacity())
            self.eager.forward([(seq, p.context - 1)])
            rewind(seq, tokens, p.context - 1, p.context)
            seqs.append(seq)
        cases = {}
        for mode, runner in (("eager", self.eager), ("graphs", self.graphed)):
            for b in p.batches:
                cases[f"{mode} {b}"] = Case(partial(runtime_decode_step, runner, seqs[:b]))
        set_attention(self.model, "sdpa")
        try:
            cases["transformers 1"] = Case(hf_decoder(self.model, random_tokens(p.context, self.vocab, 7), self.device))
            times = interleaved(self.clock, cases, p.warmup, p.steps)
        finally:
            set_attention(self.model, ATTN_IMPLEMENTATION)
        release(self.pool, seqs)
        return {
            "decode_ms": {
                mode: {str(b): stats(times[f"{mode} {b}"]) for b in p.batches} for mode in ("eager", "graphs")
            },
            "transformers_decode_b1_ms": stats(times["transformers 1"]),
            "graph_buckets": sorted(list(k) for k in self.graphed.graphs.graphs),
        }

    def prefill_and_extend(self) -> dict:
        p, cases = self.plan, {}
        seqs = []
        for n in p.prefill_lens:
            tokens = random_tokens(n, self.vocab, seed=n)
            seq = new_sequence(self.pool, f"p{n}", tokens, n)
            cases[f"prefill {n}"] = Case(partial(self.eager.forward, [(seq, n)]), partial(rewind, seq, tokens, 0, n))
            seqs.append(seq)
        tokens = random_tokens(p.context + p.extend, self.vocab, seed=3)
        ext = new_sequence(self.pool, "extend", tokens[: p.context], p.context + p.extend)
        self.eager.forward([(ext, p.context)])
        rewind(ext, tokens, p.context, p.context + p.extend)
        cases["extend"] = Case(
            partial(self.eager.forward, [(ext, p.extend)]),
            partial(rewind, ext, tokens, p.context, p.context + p.extend),
        )
        times = interleaved(self.clock, cases, 1, p.repeats)
        release(self.pool, [*seqs, ext])
        prefill = {str(n): n * 1000 / statistics.median(times[f"prefill {n}"]) for n in p.prefill_lens}
        return {"prefill_tok_s": prefill, "extend_ms": {str(p.extend): stats(times["extend"])}}

    def kv_transfers(self) -> dict:
        n = self.plan.kv_tokens
        seq = new_sequence(self.pool, "kv", random_tokens(n, self.vocab, seed=5), n)
        slots = self.pool.slots(seq.block_table, 0, n)
        nbytes = n * self.pool.layout.bytes_per_token(self.pool.dtype)
        host = self.pool.export_tokens(slots)
        cases = {
            "export": Case(partial(self.pool.export_tokens, slots)),
            "import": Case(partial(self.pool.import_tokens, slots, host)),
            "export per layer": Case(partial(export_kv, self.pool, seq.block_table, 0, n)),
        }
        times = interleaved(self.clock, cases, 1, self.plan.repeats)
        release(self.pool, [seq])
        gb_s = {name: nbytes / statistics.median(ts) / 1e6 for name, ts in times.items()}
        return {
            "kv_bytes": nbytes,
            "kv_export_gb_s": gb_s["export"],
            "kv_import_gb_s": gb_s["import"],
            "kv_export_per_layer_gb_s": gb_s["export per layer"],
            "host_buffer_pinned": bool(host.is_pinned()) if self.device.type == "cuda" else False,
        }


def run_model(name: str, device: torch.device, dtype: torch.dtype, plan: Plan, quick: bool) -> dict:
    t0 = time.perf_counter()
    model = build_model(name, device, dtype, quick)
    log(f"{name}: built in {time.perf_counter() - t0:.1f} s")
    cfg = model.config
    out = {
        "config": {
            k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size")
        },
        "params": sum(p.numel() for p in model.parameters()),
    }
    with torch.inference_mode():
        figures = Figures(model, device, plan)
        for phase in (figures.decode, figures.prefill_and_extend, figures.kv_transfers):
            log(f"{name}: {phase.__name__}")
            out.update(phase())
    out["seconds"] = time.perf_counter() - t0
    del figures, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def test_summary(junit: Path | None, rc: int | None) -> dict:
    """Counts from the pytest junit XML of the equivalence run (shell step 1)."""
    out = {"exit_code": rc, "tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if junit is not None and junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        for key in ("tests", "failures", "errors", "skipped"):
            out[key] = int(suite.get(key, 0))
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="smollm2,llama3_8b_shape")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--junit", type=Path, default=None, help="pytest junit XML of the equivalence tests")
    ap.add_argument("--tests-rc", type=int, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan = Plan.quick() if args.quick else Plan()
    meta = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "quick": args.quick,
        "graphs_captured": device.type == "cuda",
        "plan": plan.__dict__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    result = {"meta": meta, "tests": test_summary(args.junit, args.tests_rc), "models": {}}
    for name in args.models.split(","):
        result["models"][name] = run_model(name, device, dtype, plan, args.quick)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive a timeout
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
