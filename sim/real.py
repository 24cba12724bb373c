"""A real `pdd bench` run, read back and simulated: what validation (sim/validate.py) and
calibration (sim/calibrate.py) both start from.

1. `load_real`: the run's results.json and, when it kept them, its per-request records.
2. `simulate_real`: the same workload (same generator, request count, seed and rate) on a sim
   config, every mode of the run, each request given the output length the model produced.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.workloads import load_workload
from sim.config import SimConfig
from sim.run import run_modes, tokenizer_or_none
from sim.workload import from_bench


def load_real(real_dir: Path) -> tuple[dict, list[dict]]:
    """A real run's results.json and, when it kept them, its per-request records."""
    real = json.loads((real_dir / "results.json").read_text())
    path = real_dir / "requests.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return real, records


def simulate_real(real: dict, real_records: list[dict], cfg: SimConfig, progress: bool = True) -> tuple[dict, list]:
    """The real run's workload (same generator, seed, rate) on `cfg`, every one of its modes.

    Output lengths are the real ones when the run kept its records, else the generator's
    (`max_tokens`; the model stops early on few of them)."""
    w = real["workload"]
    outputs = {r["request_id"]: int(r["output_tokens"]) for r in real_records if r["ok"]}
    tokenizer = tokenizer_or_none()
    wl = load_workload(
        w["name"],
        n_requests=w["requests"],
        seed=w["seed"],
        rate_rps=w["params"].get("rate_rps", 0.5),
        tokenizer=tokenizer,
    )
    requests = from_bench(wl, tokenizer, outputs)
    return run_modes(cfg, list(real["modes"]), requests, wl.describe(), w["seed"], progress)
