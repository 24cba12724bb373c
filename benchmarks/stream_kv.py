"""What streaming a cold prompt's KV while prefill runs (`stream_kv`) saves, measured alone.

    .venv/bin/python -m benchmarks.stream_kv [--prompt 2000] [--rounds 4] [--tokens 8]
        [--pipelines p-md,p-rld-md] [--mbps 200] [--delay-ms 20]

Two clusters of the bench's float32 fleet (`pdd bench`'s `pdd` mode: prefill and relay in A,
main-decode in B behind the emulated line), one with `stream_kv: true`, one with `false`, and
nothing else different. Each round sends, to each cluster in turn, one greedy streamed completion
per pipeline on a fresh random prompt of `--prompt` token ids, forced through the pipeline
(`pdd.pipeline`): a cold prompt, prefilled in chunks of 512 tokens. Client side, per request:
TTFT (prefill's first token: the same either way), the time to the second token (the first
decoder's, once its KV landed: what streaming shortens) and E2E. Printed per pipeline and
setting, median [min..max] over rounds, and the saving on the second token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.modes import mode_config  # noqa: E402
from pdd.launcher import Cluster  # noqa: E402


def fresh(n: int, seed: int) -> list[int]:
    """A prompt no cache holds: token ids under 32,000 (in any Llama- or Qwen-family vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 32_000) for _ in range(n)]


async def one(url: str, model: str, prompt: list[int], pipeline: str, tokens: int) -> dict:
    """One streamed completion: client-side arrival times of its tokens (ms from the send), and
    its text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "pdd": {"pipeline": pipeline},
    }
    arrivals: list[float] = []
    text = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append((time.perf_counter() - t0) * 1000)
                    text.append(chunk["choices"][0]["text"])
    if len(arrivals) < 3:
        raise RuntimeError(f"{pipeline}: {len(arrivals)} text chunks came back")
    tpot = (arrivals[-1] - arrivals[1]) / (len(arrivals) - 2)  # the decoders' pace, past the first two
    return {"ttft": arrivals[0], "second": arrivals[1], "e2e": arrivals[-1], "tpot": tpot, "text": "".join(text)}


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} [{min(values):.0f}..{max(values):.0f}]"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--pipelines", default="p-md,p-rld-md")
    p.add_argument("--mbps", type=float, default=200.0)
    p.add_argument("--delay-ms", type=float, default=20.0)
    args = p.parse_args()
    pipelines = [x.strip() for x in args.pipelines.split(",") if x.strip()]
    clusters = {}
    for stream in (True, False):
        cfg = mode_config("pdd")
        cfg["wan"] = {**cfg["wan"], "bandwidth_mbps": args.mbps, "delay_ms": args.delay_ms, "jitter_ms": 0.0}
        cfg["scheduler"]["wan_mbps"] = args.mbps
        cfg["stream_kv"] = stream
        print(f"stream_kv: starting the {'streaming' if stream else 'whole-push'} cluster", flush=True)
        clusters[stream] = Cluster(log=lambda m: None, **cfg).launch()
    try:
        for c in clusters.values():
            c.wait_ready(300)
        model = httpx.get(clusters[True].url + "/v1/models").json()["data"][0]["id"]
        got: dict[tuple[bool, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for pipeline in pipelines:
                for stream, c in clusters.items():  # the same fresh prompt to both
                    prompt = fresh(args.prompt, seed=1000 * r + pipelines.index(pipeline))
                    sample = await one(c.url, model, prompt, pipeline, args.tokens)
                    got.setdefault((stream, pipeline), []).append(sample)
            print(f"stream_kv: round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for c in clusters.values():
            c.stop()
    print(f"\n{args.prompt}-token cold prompts, line {args.mbps:g} Mbps / {args.delay_ms:g} ms, ms median [min..max]:")
    print(f"{'pipeline':10} {'stream_kv':10} {'TTFT':>22} {'2nd token':>22} {'E2E':>22}")
    for pipeline in pipelines:
        for stream in (True, False):
            rows = got[(stream, pipeline)]
            cells = [summary([x[k] for x in rows]) for k in ("ttft", "second", "e2e")]
            print(f"{pipeline:10} {str(stream).lower():10} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22}")
        on = statistics.median(x["second"] for x in got[(True, pipeline)])
        off = statistics.median(x["second"] for x in got[(False, pipeline)])
        print(f"{pipeline:10} second token: {on:.0f} ms streamed vs {off:.0f} ms whole ({on / off:.2f}x)")


if __name__ == "__main__":
    asyncio.run(main())
