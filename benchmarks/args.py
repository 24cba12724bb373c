"""Command-line options of `pdd bench` (kept apart so `pdd --help` stays light)."""

from __future__ import annotations

import argparse

from benchmarks.modes import MODES


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="agentic", help="agentic | random | trace:FILE")
    p.add_argument("--modes", default="pd-local,pd-wan,pdd", help=f"comma-separated: {','.join(MODES)}")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second (agentic, random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, help="base cluster YAML (WAN settings etc.)")
    p.add_argument("--quick", action="store_true", help="a small run: every mode in minutes")
    p.add_argument("--block-tokens", type=int, default=16, help="trace: tokens per 512-token block")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace: multiply output lengths")
    p.add_argument("--max-requests", type=int, default=None, help="trace: take the first N")


def add_handoff_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--prompt-tokens", type=int, default=512)
