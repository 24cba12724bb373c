"""What lending a host's idle cores (`lend_idle_cores`, shared/cores.py) saves, measured alone.

    .venv/bin/python -m benchmarks.idle_cores [--config configs/single-host.yaml] [--rounds 6]
        [--prompt 200] [--tokens 64] [--pipelines p-md,p-rld-md]

Two clusters of the same config (the shipped one by default: prefill float32, relay and
main-decode bfloat16, `threads: auto` on one host), one lending idle cores and one not, and
nothing else different. Each round sends, to each cluster in turn, one greedy streamed
completion per pipeline on a fresh random prompt, forced through the pipeline: one request at a
time, as one user of `pdd up` sends them. Client side, per request: TTFT, TPOT (the mean gap from
the second text chunk to the last: the decoders' pace) and E2E; printed per pipeline and setting,
median [min..max] over rounds, with the lending cluster's TPOT and E2E over the other's. The
outputs of the two are compared too: the batch-invariant kernels give the same bits at any
thread count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.side_by_side import measure, table  # noqa: E402
from pdd.launcher import Cluster  # noqa: E402


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "single-host.yaml"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--pipelines", default="p-md,p-rld-md")
    args = p.parse_args()
    pipelines = [x.strip() for x in args.pipelines.split(",") if x.strip()]
    clusters = {}
    for lend in (True, False):
        print(f"idle_cores: starting the cluster {'lending' if lend else 'not lending'} idle cores", flush=True)
        clusters[lend] = Cluster(args.config, log=lambda m: None, port=0, lend_idle_cores=lend).launch()
    threads = {i.id: i.threads for i in clusters[False].cfg.instances}
    print(f"idle_cores: shares {threads}, lent up to {len(os.sched_getaffinity(0))} cores", flush=True)
    got = await measure(clusters, pipelines, args.rounds, args.prompt, args.tokens, "idle_cores")
    print(f"\n{args.prompt}-token fresh prompts, {args.tokens} tokens, one at a time, ms median [min..max]:")
    table(got, pipelines, "lend", {"TTFT": "ttft", "TPOT": "tpot", "E2E": "e2e"})
    for pipeline in pipelines:
        for k in ("tpot", "e2e"):
            ratios = [a[k] / b[k] for a, b in zip(got[(True, pipeline)], got[(False, pipeline)])]
            spread = f"[{min(ratios):.2f}..{max(ratios):.2f}]"
            print(f"{pipeline:10} {k} lending / not: {statistics.median(ratios):.2f}x {spread}")
        same = sum(a["text"] == b["text"] for a, b in zip(got[(True, pipeline)], got[(False, pipeline)]))
        print(f"{pipeline:10} outputs equal: {same} of {len(got[(True, pipeline)])}")


if __name__ == "__main__":
    asyncio.run(main())
