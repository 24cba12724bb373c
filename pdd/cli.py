"""The `pdd` command.

    pdd model-dir                 print the default model folder, provisioning it if missing
    pdd up [--config FILE]        start NATS, Redis, the WAN emulator and every service on one host
    pdd serve ROLE --config FILE --instance ID
                                  run one service alone (per-datacenter deployment)
    pdd bench [--workload W --modes M1,M2 --out DIR ...]
                                  PDD and its baselines side by side (benchmarks/bench.py)
    pdd bench handoff [--tokens 100 --reps 30]
                                  KV over the WAN vs token ids + extend (benchmarks/handoff_micro.py)
    pdd sim [--config FILE --workload W --modes M1,M2 --out DIR ...]
                                  the same modes, simulated on any fleet (sim/run.py)
    pdd sim profile               measure this machine's chip profile (sim/measure.py)
    pdd sim validate | experiments
                                  simulator vs the real bench run; the report's experiments (docs/sim)
"""

from __future__ import annotations

import argparse
import sys


def _model_dir(args: argparse.Namespace) -> int:
    from shared.runtime.provision import provision_default_model

    print(provision_default_model(log=lambda m: print(m, file=sys.stderr)))
    return 0


def _up(args: argparse.Namespace) -> int:
    from pdd.launcher import run_cluster

    return run_cluster(args.config)


def _serve(args: argparse.Namespace) -> int:
    from pdd.launcher import serve_one

    return serve_one(args.role, args.config, args.instance)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "handoff":
        from benchmarks import handoff_micro

        return handoff_micro.main(args)
    from benchmarks import bench

    return bench.main(args)


def _add_bench(sub) -> None:
    from benchmarks.args import add_bench_arguments, add_handoff_arguments

    p = sub.add_parser("bench", help="benchmarks: modes side by side, or `bench handoff`")
    p.add_argument("what", nargs="?", choices=["run", "handoff"], default="run")
    add_bench_arguments(p)
    add_handoff_arguments(p)
    p.set_defaults(func=_bench)


def _sim(args: argparse.Namespace) -> int:
    if args.what == "profile":
        from sim import measure

        return measure.main(args)
    if args.what == "validate":
        from sim import validate

        return validate.main(args)
    if args.what == "experiments":
        from sim import experiments

        return experiments.main(args)
    from sim import run

    return run.main(args)


def _add_sim(sub) -> None:
    from sim.run import add_sim_arguments

    p = sub.add_parser("sim", help="simulate the modes on any fleet; `sim profile` measures this machine")
    add_sim_arguments(p)
    p.set_defaults(func=_sim)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description="PDD: cross-datacenter P/RLD/MD LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("model-dir", help="print the default model folder (provision it if missing)").set_defaults(
        func=_model_dir
    )
    up = sub.add_parser("up", help="run the whole cluster on this host")
    up.add_argument("--config", default=None, help="cluster YAML (default configs/single-host.yaml)")
    up.set_defaults(func=_up)
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=["gateway", "scheduler", "prefill", "rld", "md", "wanlink"])
    serve.add_argument("--config", default=None)
    serve.add_argument("--instance", default=None, help="instance id from the config (default: the first)")
    serve.set_defaults(func=_serve)
    _add_bench(sub)
    _add_sim(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
