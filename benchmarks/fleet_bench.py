"""Fleet-size benchmark: scheduler throughput and plan latency with 1, 2 and 4 schedulers over a
fleet of 200 registered instances whose prefix indexes hold 100k blocks each (issue #43).

    .venv/bin/python -m benchmarks.fleet_bench [--instances 200] [--blocks 100000] \\
        [--schedulers 1,2,4] [--duration 10] [--profile] [--out fleet.json]

1. A real nats-server (no auth) and redis-server on loopback; no secrets (none configured).
2. The fleet in Redis (benchmarks/fleet_index.py): 200 heartbeats, refreshed every second with
   moving load figures; each instance's prefix index filled with its 100k block hashes.
3. Alone, at that size: `Registry.alive()`, hashing a prompt, `Registry.prefix_blocks()` over
   every instance, the plan's CPU pieces (the Submit's decode, the tasks' encode, the policy), and
   the whole `on_submit` in this process with a bus that acks at once: the scheduler's CPU per
   plan (process time), which the other processes sharing the host's cores barely move.
4. For each scheduler count K: the simulated instances (benchmarks/fleet_load.py `sim`, acking
   every task at once), K `python -m services.scheduler` processes, then the load
   (fleet_load.py `client`): closed loop at `concurrency` in flight (throughput), then open loop
   at a share of that throughput (latency below saturation). Before the schedulers shared
   submissions in a queue group, each of K schedulers planned every request: the client counts
   the extra answers (`duplicates`) and each scheduler's log the plans it made.
5. `--profile`: one more K=1 saturated run with the scheduler under cProfile; its top functions.
6. The table, its ratios to the targets (>= 1,000 plans/s per scheduler, P99 <= 10 ms, x1.7 from
   1 to 2 schedulers), and the JSON (`--out`).

Every process shares this host's cores: on a 2-core machine the load, NATS, Redis and the
simulated instances take CPU the schedulers would otherwise have; the report names the host.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import redis
import yaml

from benchmarks.fleet_index import BLOCK, Corpus, Heartbeats, fill_index, fleet, prompts
from benchmarks.fleet_load import templates
from benchmarks.fleet_pieces import time_pieces, time_plan_path, time_registry
from benchmarks.fleet_report import format_report, per_plan, pool, profile_top, summary_line
from pdd.servers import EmbeddedServer, die_with_parent, free_port
from shared.bus import Bus
from shared.config import ClusterConfig, load_config
from shared.prefix_hash import namespace_of
from shared.registry import Registry, connect
from shared.security import Secrets

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPE = {  # the default model's config.json, as much as the scheduler reads
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "eos_token_id": 2,
}


def say(msg: str) -> None:
    print(msg, flush=True)


def host() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), platform.machine())
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_busy_s() -> float:
    """CPU seconds every core of this host has been busy so far (Linux /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def child_env() -> dict[str, str]:
    """This environment without PDD_ overrides: the children read only the bench's config."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            argv, cwd=ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_cluster(run_dir: Path, nats_url: str, redis_url: str, infos, schedulers: int = 1) -> Path:
    """The schedulers' config: this fleet, these servers, no secrets, the shipped heartbeat TTL
    (a scheduler plans from its live view once it has listened for one: the phases' warm-up
    covers it), and `schedulers` of them (control_plane)."""
    model = run_dir / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    raw = {
        "model": str(model),
        "block_size": BLOCK,
        "heartbeat_ttl_s": 3.0,
        "redis_url": redis_url,
        "datacenters": {"A": {"nats_url": nats_url}, "B": {"nats_url": nats_url}},
        "instances": [{"id": i.id, "role": str(i.role), "dc": i.dc, "dtype": i.dtype} for i in infos],
    }
    if "control_plane" in {f.name for f in dataclasses.fields(ClusterConfig)}:
        raw["control_plane"] = {"schedulers": schedulers}
    path = run_dir / f"cluster-{schedulers}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = load_config(path)
    if Secrets.of(cfg) is not None:
        raise RuntimeError(f"{path} names secrets; the bench's servers have no auth")
    return path


def scheduler_names(k: int) -> list[str]:
    """As the launcher names them: `scheduler` alone, else `scheduler-0`, `scheduler-1`, ..."""
    return ["scheduler"] if k == 1 else [f"scheduler-{i}" for i in range(k)]


class Run:
    """One bench run's servers, fleet and files."""

    def __init__(self, a: argparse.Namespace, run_dir: Path) -> None:
        self.a, self.dir = a, run_dir
        self.python = sys.executable

    def client_argv(self, i: int, out: Path, mode: str, start_at: float, **kw: float) -> list[str]:
        argv = [self.python, "-m", "benchmarks.fleet_load", "client", "--nats", self.nats_url, "--redis"]
        argv += [self.redis_url, "--prompts", str(self.prompts), "--out", str(out), "--client", str(i)]
        argv += ["--mode", mode, "--start-at", str(start_at), "--duration", str(self.a.duration)]
        argv += ["--warmup", str(self.a.warmup), "--request-s", str(self.a.request_s)]
        for key, value in kw.items():
            argv += [f"--{key}", str(value)]
        return argv

    def load(self, tag: str, mode: str, watch: dict[str, int], **kw: float) -> dict:
        """Run the clients (`--clients` processes sharing the load) and pool what they saw;
        `watch`: processes whose CPU over the run is reported, by name."""
        n = self.a.clients
        start_at = time.time() + 1.5 + 0.005 * self.a.prompts  # the clients encode their prompts meanwhile
        outs = [self.dir / f"{tag}-client-{i}.json" for i in range(n)]
        share = {k: (v / n if k == "rate" else max(1, round(v / n))) for k, v in kw.items()}
        procs = [
            spawn(self.client_argv(i, out, mode, start_at, **share), self.dir / f"{tag}-client-{i}.log")
            for i, out in enumerate(outs)
        ]
        time.sleep(max(0.0, start_at + self.a.warmup - time.time()))
        before, busy = {name: cpu_s(pid) for name, pid in watch.items()}, host_busy_s()
        self.redis_stats.config_resetstat()
        time.sleep(self.a.duration)
        used = {name: cpu_s(pid) - before[name] for name, pid in watch.items()}
        busy = host_busy_s() - busy
        commands = self.redis_stats.info("commandstats")
        for p in procs:
            if p.wait(self.a.timeout + 60) != 0:
                raise RuntimeError(f"a load client failed: see {self.dir}/{tag}-client-*.log")
        phase = pool([json.loads(out.read_text()) for out in outs])
        phase["cpu_s"] = {name: round(s, 2) for name, s in used.items()}
        phase["cpu_s"]["load"] = round(phase.pop("client_cpu_s"), 2)
        phase["cpu_s"]["other processes"] = round(max(0.0, busy - sum(phase["cpu_s"].values())), 2)
        scheduler_s = sum(s for name, s in used.items() if name.startswith("scheduler"))
        phase["scheduler_cpu_ms_per_plan"] = scheduler_s * 1000 / max(phase["planned"], 1)
        phase["redis_per_plan"] = per_plan(commands, phase["planned"])
        return phase

    def schedulers(self, k: int, tag: str, profile: Path | None = None) -> list[subprocess.Popen]:
        procs, config = [], write_cluster(self.dir, self.nats_url, self.redis_url, self.infos, k)
        for i in range(k):
            argv = [self.python]
            if profile is not None:
                argv += ["-m", "cProfile", "-o", str(profile)]
            argv += ["-m", "services.scheduler", "--config", str(config), "--instance", scheduler_names(k)[i]]
            procs.append(spawn(argv, self.dir / f"{tag}-scheduler-{i}.log"))
        for i, p in enumerate(procs):
            wait_for_line(self.dir / f"{tag}-scheduler-{i}.log", "ready", p)
        return procs

    def sims(self, tag: str) -> list[tuple[subprocess.Popen, Path]]:
        out = []
        for i in range(self.a.sims):
            path = self.dir / f"{tag}-sim-{i}.json"
            argv = [self.python, "-m", "benchmarks.fleet_load", "sim", "--nats", self.nats_url, "--out", str(path)]
            out.append((spawn(argv, self.dir / f"{tag}-sim-{i}.log"), path))
        for p, path in out:
            wait_for(lambda path=path: path.with_suffix(".ready").exists(), p, f"{path.name} ready")
        return out

    def with_schedulers(self, k: int, profile: Path | None = None) -> dict:
        """Step 4 for K = `k`: fresh simulated instances and schedulers, the closed-loop phase,
        then (unless profiled) the open-loop one; every process stopped however it ends."""
        tag = f"k{k}" + ("-profiled" if profile else "")
        sims, scheds = self.sims(tag), []
        try:
            scheds = self.schedulers(k, tag, profile)
            out = self.phases(k, tag, scheds, sims, profiled=profile is not None)
        finally:
            for p in [*scheds, *(p for p, _ in sims)]:
                stop(p)
        out["plans_logged"] = [plans_logged(self.dir / f"{tag}-scheduler-{i}.log") for i in range(k)]
        out["sim"] = {}
        for _, path in sims:
            for key, n in json.loads(path.read_text()).items():
                out["sim"][key] = out["sim"].get(key, 0) + n
        return out

    def phases(self, k: int, tag: str, scheds: list, sims: list, profiled: bool) -> dict:
        watch = {f"scheduler-{i}": p.pid for i, p in enumerate(scheds)}
        watch |= {"redis": self.redis.proc.pid, "nats": self.nats.proc.pid}
        watch |= {f"sim-{i}": p.pid for i, (p, _) in enumerate(sims)}
        watch["bench (heartbeats)"] = os.getpid()
        say(f"{k} scheduler(s){' under cProfile' if profiled else ''}: closed loop, {self.a.concurrency * k} in flight")
        out = {"schedulers": k}
        out["saturated"] = self.load(f"{tag}-closed", "closed", watch, concurrency=self.a.concurrency * k)
        say(f"  {summary_line(out['saturated'])}")
        rate = self.a.paced * out["saturated"]["plans_per_s"]
        if rate > 0 and not profiled:
            say(f"  open loop at {rate:.0f}/s")
            out["paced"] = self.load(f"{tag}-open", "open", watch, rate=rate) | {"rate": rate}
            say(f"  {summary_line(out['paced'])}")
        return out


def wait_for_line(log: Path, word: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    wait_for(lambda: log.exists() and word in log.read_text(), proc, f"{word!r} in {log}", timeout)


def wait_for(ready, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.1)


def plans_logged(log: Path) -> int:
    """Plans a scheduler made for the bench's requests, by its log (one line per plan)."""
    return len(set(re.findall(r"(fleet-[0-9a-f]{4}-\d+-\d+): p-", log.read_text())))


async def prepare(run: Run) -> dict:
    """Steps 2 and 3: the fleet in Redis, the prompts, and the registry's figures alone."""
    a = run.a
    infos = fleet(a.instances)
    run.infos = infos
    config = write_cluster(run.dir, run.nats_url, run.redis_url, infos)
    namespace = namespace_of(str(run.dir / "model"))
    registry = run.registry = Registry(connect(run.redis_url), ttl_s=30.0)
    run.heartbeats = Heartbeats(registry, infos, a.blocks, bus=await Bus.connect(run.nats_url, "fleet-heartbeats"))
    await run.heartbeats.start()
    corpus = Corpus.sized(a.instances, a.blocks, a.replicas, a.min_tokens, a.max_tokens)
    say(
        f"indexing {a.instances} instances x {a.blocks:,} blocks "
        f"({corpus.documents:,} documents of {a.min_tokens}-{a.max_tokens} tokens)"
    )
    fill = await fill_index(registry, [i.id for i in infos], corpus, a.blocks, namespace, say)
    memory = await registry.r.info("memory")
    batch = prompts(corpus, a.prompts, a.hit_share)
    run.prompts = run.dir / "prompts.msgpack"
    run.prompts.write_bytes(msgpack.packb(batch))
    say("timing the registry alone")
    await registry.r.config_resetstat()
    reg = await time_registry(registry, [i.id for i in infos], batch, namespace, a.reps)
    reg["redis_per_read"] = per_plan(await registry.r.info("commandstats"), a.reps)
    pieces = time_pieces(load_config(config), infos, batch, reg.pop("hits_sample"), a.reps)
    plan_path = await time_plan_path(load_config(config), infos, templates(batch, 0), registry, max(a.reps, 200))
    pieces["Scheduler.on_submit, CPU per plan"] = plan_path
    roles = {str(r): sum(1 for i in infos if i.role == r) for r in dict.fromkeys(i.role for i in infos)}
    return {
        "fleet": {"instances": a.instances, "roles": roles, "blocks_each": a.blocks, "documents": corpus.documents},
        "index": fill | {"used_memory_human": memory["used_memory_human"], "used_memory": memory["used_memory"]},
        "registry": reg,
        "pieces": pieces,
    }


async def bench(a: argparse.Namespace, run_dir: Path) -> dict:
    run = Run(a, run_dir)
    conf, nats_port, redis_port = run_dir / "nats.conf", free_port(), free_port()
    conf.write_text(f"listen: 127.0.0.1:{nats_port}\nmax_payload: 8MB\n")
    run.nats = EmbeddedServer.nats("nats", conf, nats_port, run_dir).start()
    run.redis = EmbeddedServer.redis(redis_port, None, run_dir).start()
    run.nats_url, run.redis_url = f"nats://127.0.0.1:{nats_port}", f"redis://127.0.0.1:{redis_port}"
    run.redis_stats = redis.Redis.from_url(run.redis_url, decode_responses=True)  # the phases' threads read it
    try:
        result = {
            "host": host(),
            "cores": len(os.sched_getaffinity(0)),
            "load_before": os.getloadavg()[0],
            "head": git_head(),
            "settings": settings(a),
        }
        result |= await prepare(run)
        result["runs"] = []
        for k in a.schedulers:
            result["runs"].append(await asyncio.to_thread(run.with_schedulers, k))
            result["runs"][-1]["redis_keys"] = await run.registry.r.dbsize()
        if a.profile:
            path = run_dir / "scheduler.pstats"
            profiled = await asyncio.to_thread(run.with_schedulers, 1, path)
            result["profile"] = {
                "plans_per_s": profiled["saturated"]["plans_per_s"],
                "top": profile_top(path, profiled["plans_logged"][0]),
                "pstats": str(path),
            }
        result["load_after"] = os.getloadavg()[0]
        return result
    finally:
        if getattr(run, "heartbeats", None):
            await run.heartbeats.stop()
        if getattr(run, "registry", None):
            await run.registry.r.aclose()
        run.redis_stats.close()
        run.nats.close()
        run.redis.close()


def git_head() -> str:
    """The commit the schedulers run, and whether the tree has changes beside it."""
    try:
        head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "not a git checkout"
    if head.returncode:
        return "not a git checkout"
    return head.stdout.strip()[:100] + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def settings(a: argparse.Namespace) -> dict:
    keys = ("instances", "blocks", "schedulers", "duration", "warmup", "concurrency", "paced", "clients", "sims")
    return {k: getattr(a, k) for k in (*keys, "hit_share", "min_tokens", "max_tokens", "request_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=200)
    p.add_argument("--blocks", type=int, default=100_000, help="prefix-index blocks per instance")
    p.add_argument("--replicas", type=float, default=4.0, help="instances caching each document, on average")
    p.add_argument("--schedulers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring (> the heartbeat TTL + 1)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight per scheduler (closed loop)")
    p.add_argument("--paced", type=float, default=0.5, help="open-loop rate, a share of the saturated (0: none)")
    p.add_argument("--clients", type=int, default=1, help="load processes")
    p.add_argument("--sims", type=int, default=1, help="simulated-instance processes")
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts")
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--hit-share", type=float, default=0.7, help="prompts opening with a cached document")
    p.add_argument("--request-s", type=float, default=10.0, help="a request's life: its record is then deleted")
    p.add_argument("--reps", type=int, default=200, help="repetitions of each registry timing")
    p.add_argument("--timeout", type=float, default=10.0, help="a submit's answer, at most")
    p.add_argument("--profile", action="store_true", help="one more 1-scheduler run under cProfile")
    p.add_argument("--run-dir", default="", help="logs and files (default: a fresh temporary folder)")
    p.add_argument("--out", default="fleet.json")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir or tempfile.mkdtemp(prefix="pdd-fleet-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"fleet bench: logs in {run_dir}")
    result = asyncio.run(bench(a, run_dir))
    Path(a.out).write_text(json.dumps(result, indent=1))
    say("\n" + format_report(result))
    say(f"\nwrote {a.out}")
    runs = result["runs"]
    return 0 if all(not r["saturated"]["errors"] and not r["saturated"]["timeouts"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
