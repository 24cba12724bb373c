"""`pdd sim profile`: measure this machine's chip profile from our own runtime, write it as YAML.

What it times (SmolLM2-135M by default, the dtype and threads of the bench's instances: fp32,
one thread each), with the same `ModelRunner` / `KVPool` calls the engine makes per step
(helpers from benchmarks/runtime_bench.py), medians of a few repeats. Run it on a quiet machine:
every other busy process inflates every figure (the profile this one replaced was measured
beside other work: every decode step ~10% slower, which the host calibration then absorbed).
1. prefill of n new tokens on top of c cached ones, for (n, c) in PREFILL_CASES; least squares
   gives prefill_fixed_ms, prefill_ms_per_token, prefill_ms_per_token_ctx;
2. decode steps at batch b and context c per sequence (DECODE_CASES, anchored at the bench's
   batch sizes and contexts); least squares gives step_fixed_ms, step_ms_per_seq,
   step_ms_per_ctx_token;
3. an extend of k tokens on one sequence (EXTEND_CASES) against its decode step:
   step_ms_per_extra_token;
4. KV export + wire bytes + import of 1024 tokens (`shared.runtime.kv_payload`): kv_io_ms_per_token;
5. loopback TCP throughput of a 32 MB KV payload between two sockets: the in-DC `local.mbps`.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.runtime_bench import new_sequence, random_tokens, release, rewind, runtime_decode_step
from benchmarks.summary import percentile
from shared.runtime.kv_payload import export_kv, import_kv, layer_from_bytes, layer_to_bytes
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model
from shared.runtime.provision import provision_default_model
from shared.runtime.runner import ModelRunner

PREFILL_CASES = ((64, 0), (256, 0), (1024, 0), (2048, 0), (64, 1024), (256, 2048))
# batch x context per sequence: the bench's decoders run 1-3 sequences of 0.9-1.7K tokens (its
# requests.jsonl), so the fit is anchored there; 8 x 512 and 4 x 2048 keep its range honest
DECODE_CASES = (
    (1, 512),
    (4, 512),
    (8, 512),
    (1, 1024),
    (2, 1024),
    (3, 1024),
    (1, 1536),
    (2, 1536),
    (1, 2048),
    (4, 2048),
)
EXTEND_CASES = (16, 64)
REPEATS = 3
DECODE_REPEATS = 9  # a step is ~0.1 s (the setup prefill dominates): more repeats, a median no hiccup moves


def _ms(fn, reset=None, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        if reset is not None:
            reset()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return percentile(sorted(times[1:]), 50)


def _prefill(runner: ModelRunner, vocab: int) -> list[tuple[int, int, float]]:
    out = []
    for n, c in PREFILL_CASES:
        tokens = random_tokens(n + c, vocab, seed=n + c)
        seq = new_sequence(runner.pool, f"p{n}-{c}", tokens, n + c)
        if c:
            runner.forward([(seq, c)])
        ms = _ms(partial(runner.forward, [(seq, n)]), partial(rewind, seq, tokens, c, n + c))
        release(runner.pool, [seq])
        out.append((n, c, ms))
        print(f"  prefill {n} new on {c} cached: {ms:.1f} ms")
    return out


def _rewind_all(seqs: list, context: int) -> None:
    for seq in seqs:
        rewind(seq, seq.token_ids, context - 1, context)


def _decode(runner: ModelRunner, vocab: int) -> list[tuple[int, int, float]]:
    out = []
    for b, c in DECODE_CASES:
        seqs = []
        for i in range(b):
            tokens = random_tokens(c, vocab, seed=100 + i)
            seq = new_sequence(runner.pool, f"d{b}-{c}-{i}", tokens, c + 16)
            runner.forward([(seq, c - 1)])
            rewind(seq, tokens, c - 1, c)
            seqs.append(seq)
        ms = _ms(partial(runtime_decode_step, runner, seqs), partial(_rewind_all, seqs, c), DECODE_REPEATS)
        release(runner.pool, seqs)
        out.append((b, c, ms))
        print(f"  decode step b={b} ctx={c}: {ms:.1f} ms")
    return out


def _extend(runner: ModelRunner, vocab: int, ctx: int = 1024) -> list[tuple[int, float]]:
    out = []
    for k in EXTEND_CASES:
        tokens = random_tokens(ctx + k, vocab, seed=7 + k)
        seq = new_sequence(runner.pool, f"e{k}", tokens[:ctx], ctx + k)
        runner.forward([(seq, ctx)])
        ms = _ms(partial(runner.forward, [(seq, k)]), partial(rewind, seq, tokens, ctx, ctx + k))
        release(runner.pool, [seq])
        out.append((k, ms))
        print(f"  extend {k} on {ctx}: {ms:.1f} ms")
    return out


def _kv_io(pool: KVPool, tokens: int = 1024) -> float:
    src = pool.allocator.allocate(pool.blocks_for(tokens))
    dst = pool.allocator.allocate(pool.blocks_for(tokens))

    def roundtrip() -> None:
        payload = export_kv(pool, src, 0, tokens)
        frames = [layer_to_bytes(k, v) for k, v in payload.layers]
        payload.layers = [layer_from_bytes(payload.header, f) for f in frames]
        import_kv(pool, dst, payload)

    ms = _ms(roundtrip)
    pool.allocator.free(src)
    pool.allocator.free(dst)
    print(f"  KV export + bytes + import of {tokens} tokens: {ms:.1f} ms")
    return ms / tokens


def _loopback_mbps(nbytes: int = 32 << 20) -> float:
    a, b = socket.socketpair()
    data = bytes(nbytes)

    def drain() -> None:
        got = 0
        while got < nbytes:
            got += len(b.recv(1 << 20))

    t = threading.Thread(target=drain)
    t0 = time.perf_counter()
    t.start()
    a.sendall(data)
    t.join()
    secs = time.perf_counter() - t0
    a.close()
    b.close()
    mbps = nbytes / secs / 125_000
    print(f"  loopback: {nbytes >> 20} MB in {secs * 1000:.0f} ms = {mbps:,.0f} Mbps")
    return mbps


def fit(prefill, decode, extend, decode_b1_ctx1024: float) -> dict[str, float]:
    a = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in prefill])
    p = np.linalg.lstsq(a, np.array([ms for *_, ms in prefill]), rcond=None)[0]
    d_a = np.array([[1.0, b, b * c] for b, c, _ in decode])
    d = np.linalg.lstsq(d_a, np.array([ms for *_, ms in decode]), rcond=None)[0]
    extra = [(ms - decode_b1_ctx1024) / (k - 1) for k, ms in extend]
    return {
        "prefill_fixed_ms": float(max(p[0], 0)),
        "prefill_ms_per_token": float(max(p[1], 0)),
        "prefill_ms_per_token_ctx": float(max(p[2], 0)),
        "step_fixed_ms": float(max(d[0], 0)),
        "step_ms_per_seq": float(max(d[1], 0)),
        "step_ms_per_ctx_token": float(max(d[2], 0)),
        "step_ms_per_extra_token": float(max(percentile(sorted(extra), 50), 0)),
    }


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model = load_model(provision_default_model(log=print), "float32", "cpu")
    layout = kv_layout(model)
    pool = KVPool.with_capacity(layout, tokens=24_576, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    runner, vocab = ModelRunner(model, pool), model.config.vocab_size
    print(f"pdd sim profile: SmolLM2-135M fp32, {args.threads} thread(s)")
    with torch.inference_mode():
        prefill, decode, extend = _prefill(runner, vocab), _decode(runner, vocab), _extend(runner, vocab)
        b1_ctx1024 = next(ms for b, c, ms in decode if (b, c) == (1, 1024))
        coeffs = fit(prefill, decode, extend, decode_b1_ctx1024=b1_ctx1024)
        io = _kv_io(pool)
    kv_bytes = layout.num_layers * 2 * layout.kv_heads * layout.head_dim * 4
    profile = {
        "kv_bytes_per_token": kv_bytes,
        "kv_tokens": 32768,
        "price_per_hour": 1.0,
        "max_running": 32,
        **{k: round(v, 6) for k, v in coeffs.items()},
        "kv_io_ms_per_token": round(io, 6),
        "source": f"measured by `pdd sim profile` on this host ({time.strftime('%Y-%m-%d')}), "
        f"{args.threads} thread(s): see sim/measure.py",
    }
    raw = {
        "cases": {
            "prefill_ms": [list(x) for x in prefill],
            "decode_step_ms": [list(x) for x in decode],
            "extend_ms_on_1024": [list(x) for x in extend],
        },
        "loopback_mbps": round(_loopback_mbps()),
        "profiles": {args.name: profile},
    }
    Path(args.profile_out).write_text(yaml.safe_dump(raw, sort_keys=False))
    print(f"pdd sim profile: wrote {args.profile_out}")
    return 0
