"""`pdd bench handoff`: the report's handoff microbenchmark on our stack.

Hand N generated tokens (default 100) of a request to main-decode two ways, `--reps` times:
  (a) KV: export their KV, push it over our KV transport through the emulated line (jitter and
      bandwidth swings), import it on the receiver; once in plaintext and once under the
      mutual TLS every push to the other site uses (the cluster's certificates, `pdd certs`);
  (b) token ids: send a HandoffChunk over a real NATS server whose connection crosses the same
      line; the receiver extends the N tokens on top of the prompt's KV in one forward and acks.
The TLS push runs twice: on a connection dialed at the push, and on one dialed beforehand (as
prefill dials main-decode's when the task comes, `EarlyConnection`), which saves the TCP and TLS
handshakes' two round trips. Prints payload bytes and latency mean / max / std of each (the report: 4649 KB vs 1.5 KB;
KV mean 185 ms, max 512.6 ms; recompute mean 305 ms, max 321.4 ms, std 4.8 ms), and what TLS
costs: the same KV pushed over loopback without the line, MB/s in plaintext and under TLS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.stats import percentile
from pdd.certs import make_secrets
from pdd.servers import EmbeddedServer, free_port
from services.wanlink.link import Forward, WanLink
from shared.bus import Bus
from shared.config import WanConfig, load_config
from shared.kv_push import KVPush
from shared.kv_receive import KVReceiver
from shared.kv_send import EarlyConnection, send_kv
from shared.kv_transport import FirstToken, Transfer, TransferHead
from shared.messages import Ack, HandoffChunk, Sampling
from shared.runtime.engine import Engine
from shared.runtime.kv_payload import export_kv, import_layer, layer_to_bytes, payload_from_parts
from shared.runtime.models import load_model
from shared.runtime.provision import provision_default_model
from shared.runtime.sequence import Sequence
from shared.security import Secrets

WAN = WanConfig(
    bandwidth_mbps=400.0,
    delay_ms=20.0,
    jitter_ms=10.0,
    swing="random_walk",
    walk_step=0.5,
    walk_min_mbps=150.0,
    walk_max_mbps=800.0,
    seed=7,
)


def _prepared(n_prompt: int, n_tokens: int):
    """A model engine holding a prompt's KV plus N generated tokens (the relay's state)."""
    model = load_model(provision_default_model())
    engine = Engine.for_model(model, num_blocks=(n_prompt + n_tokens) // 16 + 4)
    ids = torch.randint(100, 40_000, (n_prompt + n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = Sequence("h", ids, Sampling(max_tokens=1))
    seq.block_table = engine.pool.allocator.allocate(engine.pool.blocks_for(len(ids)))
    engine.runner.forward([(seq, len(ids))])  # KV of prompt + tokens, as relay holds it
    seq.num_computed = n_prompt  # main-decode's view: the prompt's KV only
    return engine, seq


async def _kv_path(
    engine, seq, n_prompt: int, n_tokens: int, reps: int, secrets: Secrets | None, line: bool = True, early=False
) -> tuple[list[float], int]:
    """Push the N tokens' KV `reps` times (through the line unless `line` is False); with
    `secrets`, under mutual TLS as prefill-0 -> md-0. With `early`, on a connection dialed
    before the clock starts, as prefill dials main-decode's while it computes the prompt."""
    payload = export_kv(engine.pool, seq.block_table, n_prompt, n_prompt + n_tokens)
    slots = engine.pool.slots(seq.block_table, n_prompt, n_prompt + n_tokens)

    async def receive(t: Transfer) -> str:
        kv = payload_from_parts(t.head.kv, [(p.start, p.end, p.layers) for p in t.parts])
        for layer, (k, v) in enumerate(kv.layers):
            import_layer(engine.pool, slots, layer, k, v)
        return ""

    receiver = KVReceiver(receive, stall_s=30, tls=secrets.kv_server_context("md-0") if secrets else None)
    port = await receiver.start()
    link = WanLink(WAN, [Forward("md-0", "A", ("127.0.0.1", port))]) if line else None
    if link:
        await link.start()
        port = link.ports["md-0"]
    tls = secrets.kv_client_context("prefill-0") if secrets else None
    times, size = [], 0
    for i in range(reps):
        conn = await EarlyConnection("127.0.0.1", port, 30, tls, "md-0").take() if early else None
        t0 = time.perf_counter()
        layers = [layer_to_bytes(k, v) for k, v in payload.layers]
        head = TransferHead(request_id=f"kv-{i}", sender="prefill-0", secret="bench", kv=payload.header, wan=True)
        push = KVPush(head, layers, FirstToken(0))
        size = await send_kv("127.0.0.1", port, push, 30, tls=tls, server_name="md-0", conn=conn)
        times.append((time.perf_counter() - t0) * 1000)
    if link:
        await link.stop()
    await receiver.stop()
    return times, size


async def _ids_path(engine, seq, n_prompt: int, n_tokens: int, reps: int, run_dir: Path) -> tuple[list[float], int]:
    """The token ids' way: a HandoffChunk over NATS, the client's connection crossing the line."""
    conf, nats_port = run_dir / "nats.conf", free_port()
    conf.write_text(f"listen: 127.0.0.1:{nats_port}\n")
    server = EmbeddedServer.nats("nats", conf, nats_port, run_dir).start()
    link = WanLink(WAN, [Forward("nats", "B", ("127.0.0.1", nats_port))])
    await link.start()
    near = await Bus.connect(f"nats://127.0.0.1:{nats_port}", "handoff-bench-md")  # main-decode, beside the server
    far = await Bus.connect(f"nats://127.0.0.1:{link.ports['nats']}", "handoff-bench-rld")  # the relay, across

    async def extend(chunk: HandoffChunk) -> Ack:
        seq.num_computed = n_prompt
        await asyncio.to_thread(engine.runner.forward, [(seq, len(chunk.token_ids))])
        return Ack(chunk.request_id)

    await near.serve("bench.handoff", HandoffChunk, extend)
    times, chunk = [], HandoffChunk("ids", 1, seq.token_ids[n_prompt:], final=True)
    for _ in range(reps):
        t0 = time.perf_counter()
        await far.request("bench.handoff", chunk, Ack, 30)
        times.append((time.perf_counter() - t0) * 1000)
    await far.close()
    await near.close()
    await link.stop()
    server.close()
    return times, len(chunk.encode())


def _stats(times: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.mean(times),
        "max": max(times),
        "std": statistics.pstdev(times),
        "p50": percentile(sorted(times), 50),
    }


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(2)
    engine, seq = _prepared(args.prompt_tokens, args.tokens)
    n, m, reps = args.prompt_tokens, args.tokens, args.reps
    with tempfile.TemporaryDirectory(prefix="pdd-handoff-") as tmp:
        secrets = Secrets(make_secrets(load_config(), Path(tmp) / "secrets"))
        print(f"pdd bench handoff: {reps} reps of each path ({m} tokens after a {n}-token prompt)", flush=True)
        kv_times, kv_bytes = asyncio.run(_kv_path(engine, seq, n, m, reps, None))
        tls_times, _ = asyncio.run(_kv_path(engine, seq, n, m, reps, secrets))
        early_times, _ = asyncio.run(_kv_path(engine, seq, n, m, reps, secrets, early=True))
        id_times, id_bytes = asyncio.run(_ids_path(engine, seq, n, m, reps, Path(tmp)))
        raw = {
            name: asyncio.run(_kv_path(engine, seq, n, m, reps, sec, line=False))[0]
            for name, sec in (("plain", None), ("tls", secrets))
        }
    result = {
        "tokens": m,
        "reps": reps,
        "wan": WAN.__dict__,
        "kv": {"payload_bytes": kv_bytes, **_stats(kv_times)},
        "kv_tls": {"payload_bytes": kv_bytes, **_stats(tls_times)},
        "kv_tls_early": {"payload_bytes": kv_bytes, **_stats(early_times)},
        "token_ids": {"payload_bytes": id_bytes, **_stats(id_times)},
        "loopback": {
            name: {**_stats(t), "mb_per_s": kv_bytes / 1e6 / (statistics.median(t) / 1000)} for name, t in raw.items()
        },
    }
    print(f"through the line ({WAN.bandwidth_mbps:.0f} Mbps random walk, {WAN.delay_ms:.0f}+-{WAN.jitter_ms:.0f} ms):")
    paths = (
        ("kv", "KV, plaintext"),
        ("kv_tls", "KV, mutual TLS"),
        ("kv_tls_early", "KV, TLS, dialed early"),
        ("token_ids", "token ids + extend"),
    )
    for name, label in paths:
        r = result[name]
        print(
            f"  {label:<22} payload {r['payload_bytes'] / 1024:>8.1f} KB   mean {r['mean']:7.1f} ms   "
            f"p50 {r['p50']:7.1f} ms   max {r['max']:7.1f} ms   std {r['std']:6.1f} ms"
        )
    saved = result["kv_tls"]["p50"] - result["kv_tls_early"]["p50"]
    print(f"  the early dial saves {saved:.1f} ms at the median: {saved / (2 * WAN.delay_ms):.1f} round trips")
    print("loopback, no line (what TLS itself costs):")
    for name, r in result["loopback"].items():
        print(f"  KV, {name:<16} median {r['p50']:7.2f} ms   {r['mb_per_s']:8.1f} MB/s")
    if args.out:  # pdd bench handoff --out DIR
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "handoff.json").write_text(json.dumps(result, indent=2))
    return 0
