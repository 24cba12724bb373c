"""Command-line options of `pdd sim` (kept apart so `pdd --help` stays light: no torch, no matplotlib)."""

from __future__ import annotations

import argparse

from benchmarks.modes import MODES


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", nargs="?", choices=["run", "profile", "validate", "experiments"], default="run")
    p.add_argument("--config", default="configs/sim/single-host-cpu.yaml", help="fleet YAML (configs/sim/)")
    p.add_argument("--workload", default="agentic", help="agentic | agents | random | trace:FILE | hitmix:H")
    p.add_argument("--modes", default="pd-local,pd-wan,pdd", help=f"comma-separated: {','.join(MODES)}")
    p.add_argument("--out", default="sim-out")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second (agentic, agents, random, hitmix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=16, help="trace: tokens per 512-token block")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace: multiply output lengths")
    p.add_argument("--max-requests", type=int, default=None, help="trace: take the first N lines")
    p.add_argument("--max-context", type=int, default=8192, help="trace: longest prompt + answer")
    p.add_argument("--loops", type=int, default=1, help="trace: replay it this many times back to back")
    p.add_argument("--max-plot-requests", type=int, default=5000)
    p.add_argument("--no-tokenizer", action="store_true", help="agentic: estimate token counts (chars/3)")
    p.add_argument(
        "--real",
        action="append",
        default=None,
        help="validate: a real `pdd bench` run's folder; give it once per run to compare with their mean "
        "(default: docs/bench-agentic)",
    )
    p.add_argument(
        "--as-config",
        action="store_true",
        help="validate: simulate every run with --config's knobs as they are, not with those whose real "
        "default changed set as the run's code had them (sim/real.py)",
    )
    p.add_argument("--only", default="", help="experiments: a subset, e.g. oscillation,bathtub")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="validate: fit the config's host: costs to --real instead (sim/calibrate.py)",
    )
    p.add_argument("--threads", type=int, default=1, help="profile: torch threads (the bench's instances use 1)")
    p.add_argument("--name", default="cpu-2core-smollm2-fp32", help="profile: its name in the YAML")
    p.add_argument("--profile-out", default="configs/sim/cpu-profile.yaml", help="profile: where to write it")
