"""How long a cluster takes to boot and to stop, forked from the fork server or started fresh.

`python benchmarks/boot_bench.py [--config FILE] [--rounds 3]` boots the cluster (the default:
configs/single-host.yaml) alternately both ways, in one run:
  - forked: every service a child of the launcher's fork server (pdd/forkserver.py), which has
    imported torch, transformers and the services once; the server is started before the
    round, as `pdd up` has it before its first service;
  - fresh: every service its own `python -m services.<role>`, as on a GPU or with `pdd serve`.
Per round it prints the seconds to ready (the gateway reports every role alive), the CPU
seconds each engine used to get there, and the seconds `stop()` took; then the medians and
their ratios. The fork server's own imports (~2.5 s of one core, once per launching process) are
printed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdd.launcher import Cluster, fork_server  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def boot(config: str | None, forked: bool) -> dict:
    cluster = Cluster(config, log=lambda m: None, port=0)
    cluster.forked = forked
    t0 = time.monotonic()
    cluster.launch()
    try:
        cluster.wait_ready(300)
        ready = time.monotonic() - t0
        engines = [cpu_s(cluster.procs[i.id].pid) for i in cluster.cfg.instances]
    finally:
        t1 = time.monotonic()
        cluster.stop()
        stop = time.monotonic() - t1
    return {"ready_s": ready, "engine_cpu_s": statistics.median(engines), "stop_s": stop}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="cluster YAML (default configs/single-host.yaml)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    t0 = time.monotonic()
    fork_server(Path(tempfile.mkdtemp(prefix="pdd-boot-"))).ping()  # answers once its imports are done
    print(f"fork server: imports done in {time.monotonic() - t0:.1f} s (once per launching process)")
    runs: dict[str, list[dict]] = {"forked": [], "fresh": []}
    for r in range(args.rounds):
        for way in runs:
            runs[way].append(m := boot(args.config, way == "forked"))
            print(
                f"round {r + 1} {way:6s}: ready {m['ready_s']:5.2f} s, engine CPU {m['engine_cpu_s']:5.2f} s, "
                f"stop {m['stop_s']:5.2f} s",
                flush=True,
            )
    med = {w: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for w, ms in runs.items()}
    print(f"\nmedian of {args.rounds} rounds | forked | fresh | fresh / forked")
    for key in ("ready_s", "engine_cpu_s", "stop_s"):
        f, s = med["forked"][key], med["fresh"][key]
        print(f"{key:12s} | {f:6.2f} | {s:6.2f} | {s / f:4.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
