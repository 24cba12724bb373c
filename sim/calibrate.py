"""`pdd sim validate --calibrate --real RUN`: fit the host's costs (sim/host.py) to one real run.

The host section's costs that no chip profile can measure (the control plane's per-request
cost, the CPU the control plane takes while requests are in flight, a fresh process's warm-up,
the WAN emulator's CPU while it carries KV)
are fitted here on a *calibration* run, which must not be the run the simulator is then
validated against (docs/sim/README.md names which run does what):
1. Read the calibration run (its summary figures suffice; per-request records sharpen the
   output lengths when present).
2. Simulate every mode of it (the knobs whose real default changed set as the run's code had
   them, sim/real.py `as_recorded`) for each point of GRID (cores and interleaving stay as the config
   says: they are facts about the machine and the engine, not fitted).
3. Score a point by the mean squared log error of TTFT P50 / P90 / P99 and TPOT P50 over the
   run's modes; print the best points and write calibration.json to `--out`.
The chosen values are then written by hand into the config's `host:` section, with this
command as their source.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

from sim.config import SimConfig, load_sim_config
from sim.real import as_recorded, load_real, simulate_real

GRID = {
    "request_overhead_ms": (0.0, 25.0, 50.0, 75.0, 100.0, 150.0),
    "background_cores": (0.0, 0.5, 1.0),
    "cold_start_ms": (0.0, 500.0, 1000.0, 1500.0, 2000.0),
    "wan_proxy_cores": (0.0, 0.5, 1.0),
}
SCORED = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("ttft_ms", "p99"), ("tpot_ms", "p50"))


def score(real: dict, simulated: dict) -> float:
    errs = [math.log(simulated["modes"][m][k][s] / r[k][s]) for m, r in real["modes"].items() for k, s in SCORED]
    return sum(e * e for e in errs) / len(errs)


def with_host(cfg: SimConfig, **values: float) -> SimConfig:
    return dataclasses.replace(cfg, host={**cfg.host, **values})


def main(args: argparse.Namespace) -> int:
    real, records = load_real(Path(args.real))
    cfg = load_sim_config(args.config)
    if not getattr(args, "as_config", False):  # the knobs whose real default changed, as the run had them
        cfg, knobs, how = as_recorded(cfg, real)
        print(f"pdd sim validate --calibrate: {args.real}: {knobs} ({how})", file=sys.stderr)
    points = []
    for values in itertools.product(*GRID.values()):
        point = dict(zip(GRID, values, strict=True))
        simulated, _ = simulate_real(real, records, with_host(cfg, **point), progress=False)
        points.append({**point, "score": score(real, simulated)})
    points.sort(key=lambda p: p["score"])
    for p in points[:8]:
        print(json.dumps(p), file=sys.stderr)
    best = {k: v for k, v in points[0].items() if k != "score"}
    simulated, _ = simulate_real(real, records, with_host(cfg, **best), progress=False)
    errors = {
        m: {f"{k} {s}": simulated["modes"][m][k][s] / r[k][s] - 1 for k, s in SCORED} for m, r in real["modes"].items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "real": args.real,
        "config": args.config,
        "grid": GRID,
        "best": points[0],
        "top": points[:8],
        "errors": errors,
    }
    (out / "calibration.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({"best": points[0], "errors": errors}, indent=1))
    return 0
