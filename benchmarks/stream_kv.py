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
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.modes import mode_config  # noqa: E402
from benchmarks.side_by_side import measure, table  # noqa: E402
from pdd.launcher import Cluster  # noqa: E402


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
    got = await measure(clusters, pipelines, args.rounds, args.prompt, args.tokens, "stream_kv")
    print(f"\n{args.prompt}-token cold prompts, line {args.mbps:g} Mbps / {args.delay_ms:g} ms, ms median [min..max]:")
    table(got, pipelines, "stream_kv", {"TTFT": "ttft", "2nd token": "second", "E2E": "e2e"})
    for pipeline in pipelines:
        on = statistics.median(x["second"] for x in got[(True, pipeline)])
        off = statistics.median(x["second"] for x in got[(False, pipeline)])
        print(f"{pipeline:10} second token: {on:.0f} ms streamed vs {off:.0f} ms whole ({on / off:.2f}x)")


if __name__ == "__main__":
    asyncio.run(main())
