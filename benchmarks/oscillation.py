"""The oscillation guard, shown: a burst of low-hit requests against a 1-slot relay pool, with
RLD admission control on and off, stepped through the scheduler's own `choose_plan`.

    .venv/bin/python -m benchmarks.oscillation [--requests 60] [--gap-ms 250] [--rld-slots 1]

The relay's residency per request (until handoff frees it) is the WAN time it hides; the queue
model is services/scheduler/simulate.py. Without the guard the burst piles onto the relay and
its queue (and every relayed TTFT) grows with the burst; with it the relay holds at most its
slots and the overflow takes p-md with a bounded TTFT penalty.
"""

from __future__ import annotations

import argparse

from services.scheduler.policy import PolicyConfig
from services.scheduler.simulate import simulate_burst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--gap-ms", type=float, default=250.0, help="time between arrivals")
    p.add_argument("--rld-slots", type=int, default=1)
    p.add_argument("--residency-ms", type=float, default=2000.0, help="relay time per request")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    a = p.parse_args()
    cfg = PolicyConfig(ttft_slo_ms=1000.0, wan_mbps=200.0)
    r = simulate_burst(a.requests, a.gap_ms, a.rld_slots, a.residency_ms, cfg, prompt_len=a.prompt_tokens)
    print(f"{a.requests} low-hit requests every {a.gap_ms:.0f} ms onto {a.rld_slots} relay slot(s), "
          f"{a.residency_ms:.0f} ms each (offered relay load {r['offered_rld_load']:.1f}x):")
    for side in ("guard_off", "guard_on"):
        s = r[side]
        print(f"  {side.replace('_', ' '):<9}  max RLD queue {s['max_rld_queue']:>4}   "
              f"TTFT P50 {s['ttft_p50_ms']:>8.0f} ms"
              f"   P99 {s['ttft_p99_ms']:>8.0f} ms   plans {s['reasons']}")


if __name__ == "__main__":
    main()
