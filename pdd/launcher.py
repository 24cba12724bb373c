"""One-host launcher: both sites (a NATS server each, Redis in the scheduler's), the emulated
line between them, and every service, as child processes.

Lifecycle of a cluster:
1. `Cluster(config)`: the config is resolved for this host (pdd/topology.py): free ports, site
   URLs, the forwards through the line, a throwaway CA and one bundle of credentials per
   process unless it names its own set.
2. `launch()`: the servers start from their site's bundle (each site's NATS with its users,
   permissions and leafnode link; Redis with its ACL users), then every service process, each
   pointed at its own bundle (PDD_SECRETS_DIR), none waited for; `wait_ready()`
   returns once the gateway reports every role alive. `start()` is both. The test suite
   launches its clusters at session start and waits for them only when a test needs one.
3. `kill(name)` / `start_process(name)`: faults and restarts for the tests.
4. `stop()`: SIGTERM to the services, then to the line, SIGKILL to any left, then the servers:
   no process outlives the cluster. Each child logs to `<run_dir>/<name>.log`.

On a CPU host the services are forked from one fork server per launching process
(pdd/forkserver.py), which has imported torch, transformers and the services once: an engine
boots on 1.5-2.1 s of CPU instead of 4.5-4.7 s (benchmarks/boot_bench.py), and a restart is
as quick. On a GPU each service starts as a fresh `python -m services.<role>`, as `pdd serve`
always does.

`pdd up` runs `Cluster(...).start()` and waits for Ctrl-C; the tests and `pdd bench` use the
same class, so there is one way to bring a cluster up.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdd import footprint
from pdd.control import write_state
from pdd.forkserver import ForkedProcess, ForkServer
from pdd.natsconf import server_conf
from pdd.redisconf import sentinel_lines, server_lines
from pdd.servers import EmbeddedServer, die_with_parent, redis_has_selectors
from pdd.topology import plan_processes, resolve
from shared import cores
from shared.config import (
    ClusterConfig,
    ConfigError,
    InstanceConfig,
    config_from_dict,
    load_config,
    serving_problems,
    to_dict,
)
from shared.pipelines import ROLES
from shared.security import Secrets, bundle_name, site_bundle

ROOT = Path(__file__).resolve().parent.parent
# the run config says it all
CHILD_ENV_DROPPED = ("PDD_NATS_URL", "PDD_REDIS_URL", "PDD_REDIS_SENTINELS", "PDD_SECRETS_DIR", cores.ENV)
_fork_server: ForkServer | None = None  # one per launching process, started by its first cluster


def child_env() -> dict[str, str]:
    """The services' environment: the launcher's, less what the run config says, plus
    - two malloc arenas: the engine's worker and asyncio's threads otherwise each grow their own heap;
    - OpenMP threads that sleep when idle after a short spin (unless the caller chose): every
      instance of a host has its own OpenMP pool; spinning ones burn the cores the busy instance
      needs, and ones that sleep at once make a second thread worth nothing (shared/cores.py)."""
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROPPED}
    return env | cores.openmp_env(env) | {"PYTHONUNBUFFERED": "1", "MALLOC_ARENA_MAX": "2"}


def fork_server(log_dir: Path) -> ForkServer:
    """This process's fork server (pdd/forkserver.py), started on first use; it exits with us."""
    global _fork_server
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("start the fork server from the main thread; a child of another thread dies with it")
    if _fork_server is None or not _fork_server.alive():
        _fork_server = ForkServer(child_env(), log_dir / "forkserver.log")
        atexit.register(_fork_server.close)
    return _fork_server


def serve_argv(role: str, config_path: str | None, instance: str | None) -> list[str]:
    argv = [sys.executable, "-m", f"services.{role}"]
    if config_path:
        argv += ["--config", config_path]
    if instance:
        argv += ["--instance", instance]
    return argv


class Cluster:
    def __init__(
        self, config: str | Path | dict | None = None, log=print, failpoints: bool = False, **overrides: Any
    ) -> None:
        """`failpoints`: every service reads `<run dir>/failpoints` (shared/failpoints.py), where
        tests and the chaos bench switch faults on and off while it runs."""
        given = config_from_dict(config, **overrides) if isinstance(config, dict) else load_config(config, **overrides)
        self.log = log
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdd-cluster-"))
        self.embedded_nats = [dc.name for dc in given.datacenters if not dc.nats_url]
        self.embedded_redis = not given.redis_url
        self.cfg: ClusterConfig = resolve(given, self.run_dir)
        self.config_path = str(self.run_dir / "config.yaml")
        Path(self.config_path).write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        self.secrets = Secrets.of(self.cfg)
        self.specs = {s.name: s for s in plan_processes(self.cfg, self.config_path)}
        self.servers: dict[str, EmbeddedServer] = {}
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        # a CUDA context does not survive fork: on a GPU every service starts as a fresh process
        self.forked = all((self.cfg.device or i.device) == "cpu" for i in self.cfg.instances)
        self.failpoints = self.run_dir / "failpoints" if failpoints else None
        self.core_slots: dict[str, str] = {}  # instance -> its slot of its host's core board
        for k, group in enumerate(given.core_boards()):
            board = cores.create(self.run_dir / f"cores-{k}", len(group))
            self.core_slots |= {inst.id: cores.env_value(board, slot) for slot, inst in enumerate(group)}

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def urls(self) -> dict[str, str]:
        """Every gateway's URL, by name (the first one's is `url`)."""
        return {g: f"http://{self.cfg.host}:{self.cfg.gateway_port(g)}" for g in self.cfg.control_plane.gateway_names}

    def server_pids(self) -> dict[str, int]:
        """The NATS and Redis servers this cluster started that are running, by name."""
        return {name: s.proc.pid for name, s in self.servers.items() if s.proc and s.proc.poll() is None}

    def nats_url(self, dc: str | None = None) -> str:
        return self.cfg.datacenter(dc or self.cfg.control_dc).nats_url

    # -- start ----------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> Cluster:
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> Cluster:
        """Start the servers and every process; wait for none of the processes."""
        if self.procs:
            raise RuntimeError("cluster already started (`with Cluster(...)` starts it; do not also call start())")
        try:
            if self.forked:  # its imports overlap the servers' start
                fork_server(self.run_dir)
            self.start_servers()
            for name in self.specs:
                self.start_process(name)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        def healthy() -> bool:
            try:
                return all(httpx.get(f"{url}/health", timeout=1.0).status_code == 200 for url in self.urls.values())
            except httpx.HTTPError:
                return False

        self._until(healthy, timeout, "the gateway to report every role alive")
        self.log(f"pdd: cluster ready at {self.url} (logs in {self.run_dir})")

    def start_servers(self) -> None:
        """Each site's NATS servers and, embedded, Redis: what `launch()` starts before the processes."""
        for dc in self.cfg.datacenters:
            if dc.name in self.embedded_nats:
                for server in self.cfg.nats_servers(dc.name):
                    conf = self.run_dir / f"{server.name}.conf"
                    conf.write_text(server_conf(self.cfg, dc, self._site(dc.name), server=server))
                    self.log(f"pdd: starting the NATS server {server.name} of datacenter {dc.name}")
                    self.servers[server.name] = EmbeddedServer.nats(server.name, conf, server.port, self.run_dir)
                    self.servers[server.name].start()
        if self.embedded_redis:
            self._start_redis()

    def _site(self, dc: str) -> Secrets | None:
        """What site `dc`'s servers are given of the secrets: its bundle alone."""
        return self.secrets.bundle(site_bundle(dc)) if self.secrets else None

    def _start_redis(self) -> None:
        """Redis, its replicas (each of the primary), then the Sentinels watching them; each with
        the ACL users of the site's bundle (pdd/redisconf.py)."""
        plane, primary = self.cfg.control_plane, self.cfg.redis_port
        site = self._site(self.cfg.control_dc)
        auth = server_lines(site, redis_has_selectors()) if site else []
        self.log(f"pdd: starting Redis (datacenter {self.cfg.control_dc})")
        self.servers["redis"] = EmbeddedServer.redis(primary, None, self.run_dir, auth=auth).start()
        for name in plane.replica_names:
            self.log(f"pdd: starting the Redis replica {name}")
            server = EmbeddedServer.redis(plane.ports[name], None, self.run_dir, name, replica_of=primary, auth=auth)
            self.servers[name] = server.start()
        quorum = plane.sentinels // 2 + 1
        for name in plane.sentinel_names:
            self.log(f"pdd: starting the Redis Sentinel {name}")
            server = EmbeddedServer.sentinel(
                name,
                plane.ports[name],
                plane.redis_master,
                primary,
                quorum,
                plane.sentinel_down_ms,
                None,
                self.run_dir,
                auth=sentinel_lines(site, plane.redis_master) if site else [],
            )
            self.servers[name] = server.start()

    def start_process(self, name: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the forking thread exits: the child would die with it
            raise RuntimeError(f"start {name} from the main thread; a child of another thread dies with it")
        spec = self.specs[name]
        argv = serve_argv(spec.role, self.config_path, name if name != spec.role else None)
        env, log_path = self.process_env(name), self.run_dir / f"{name}.log"
        self.log(f"pdd: starting {name}" + (f" (datacenter {spec.dc})" if spec.dc else " (the line between sites)"))
        if self.forked:  # the imports are done once, in the fork server: an engine boots in ~half the CPU
            self.procs[name] = fork_server(self.run_dir).spawn(argv[2], argv[3:], env, log_path)
            return
        with open(log_path, "ab") as logf:
            self.procs[name] = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def process_env(self, name: str) -> dict[str, str]:
        """Process `name`'s environment: `child_env()`, its own bundle of the secrets (not the
        whole set the run config names), the failpoints file, its slot of the core board."""
        env = child_env()
        if self.secrets is not None:
            env["PDD_SECRETS_DIR"] = str(self.secrets.bundle(bundle_name(self.specs[name].role, name)).directory)
        if self.failpoints is not None:
            env["PDD_FAILPOINTS_FILE"] = str(self.failpoints)
        if name in self.core_slots:
            env[cores.ENV] = self.core_slots[name]
        return env

    def _until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.run_dir / name}.log")
            if predicate():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.run_dir}")

    # -- faults and stop ------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            _signal_group(proc, sig)
            proc.wait(10)

    def stop(self) -> None:
        """The services first (a service in B says it leaves over the line, so the line must still
        be up), then the line, then the servers."""
        try:
            services = [p for name, p in self.procs.items() if self.specs[name].dc]
            _terminate(services)
            _terminate([p for p in self.procs.values() if p not in services])
        finally:
            for server in self.servers.values():
                server.close()
            self.procs.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(procs: list[subprocess.Popen | ForkedProcess], grace_s: float = 10.0) -> None:
    """SIGTERM to each, then SIGKILL to any still running after `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # already gone
        pass


def serve_one(role: str, config_path: str | None, instance: str | None) -> int:
    """`pdd serve ROLE`: check the config can run it, then become that service."""
    path = str(Path(config_path).resolve()) if config_path else None  # relative to where the user stands
    try:
        cfg = load_config(path)
        problems = serving_problems(cfg, role, instance)
    except ConfigError as e:
        problems = [str(e)]
    if problems:
        for p in problems:
            print(f"pdd serve {role}: {p}", file=sys.stderr)
        return 2
    argv = serve_argv(role, path, instance)
    if role in ROLES and shares_host(cfg, cfg.instance(instance, role)):
        # idle threads sleep, unless the caller chose; no spin first (child_env's): with no launcher
        # there is no core board, and a spin beside instances stepping at once costs (shared/cores.py)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.chdir(ROOT)
    os.execv(argv[0], argv)


def shares_host(cfg: ClusterConfig, me: InstanceConfig) -> bool:
    """Whether another model instance of the config runs on this instance's host."""
    return any(i.id != me.id and (i.host or cfg.host) == (me.host or cfg.host) for i in cfg.instances)


def supervise(cluster: Cluster, stop: threading.Event, on_restart, most: int = 5, per_s: float = 60.0) -> None:
    """Until `stop`: a service or server that exits is started again (its peers carry on: a
    restarted scheduler, NATS server or Redis rejoins them), unless it exited `most` times within
    `per_s` seconds: then everything stops, as the process is failing, not failing over."""
    exits: deque[float] = deque()
    while not stop.is_set():
        dead = [name for name, proc in cluster.procs.items() if proc.poll() is not None]
        dead += [name for name, s in cluster.servers.items() if s.proc is not None and s.proc.poll() is not None]
        for name in dead:
            now = time.monotonic()
            exits.append(now)
            while exits and now - exits[0] > per_s:
                exits.popleft()
            if len(exits) > most:
                print(f"pdd: {name} exited; {len(exits)} exits within {per_s:.0f}s: stopping", file=sys.stderr)
                stop.set()
                return
            if name in cluster.procs:
                print(f"pdd: {name} exited with {cluster.procs[name].returncode}; starting it again", file=sys.stderr)
                cluster.start_process(name)
            else:
                print(f"pdd: the server {name} exited; starting it again", file=sys.stderr)
                cluster.servers[name].start()
            on_restart()
        stop.wait(0.5)


def run_cluster(config_path: str | None, **overrides: Any) -> int:
    """`pdd up`: the whole two-site cluster on this host until Ctrl-C."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = Cluster(config_path, **overrides)
    throwaway = Path(cluster.cfg.secrets_dir).is_relative_to(cluster.run_dir)
    cluster.start()
    state = write_state(cluster.url, cluster.cfg.port, cluster.config_path, cluster.server_pids())
    print(f"PDD serving on {cluster.url}  (OpenAI API: {cluster.url}/v1; Ctrl-C stops everything)", flush=True)
    if len(cluster.urls) > 1:
        print(f"pdd: gateways: {', '.join(f'{n} {u}' for n, u in cluster.urls.items())}", flush=True)
    for dc in cluster.cfg.datacenters:
        names = [s.name for s in cluster.specs.values() if s.dc == dc.name]
        print(f"pdd: datacenter {dc.name}: {', '.join(names)} (NATS {dc.nats_url})", flush=True)
    if cluster.cfg.wan.enabled:
        print(
            f"pdd: the line between them: {cluster.cfg.wan.bandwidth_mbps:g} Mbps, {cluster.cfg.wan.delay_ms:g} ms "
            f"one way (`pdd wan show`)",
            flush=True,
        )
    threads = ", ".join(f"{i.id} {i.threads}" for i in cluster.cfg.instances)
    print(f"pdd: torch threads on {len(os.sched_getaffinity(0))} cores: {threads}", flush=True)
    pools, fits = footprint.summary(footprint.pool_bytes(cluster.cfg), footprint.available_bytes())
    print(f"pdd: {pools}" if fits else f"pdd: WARNING: {pools}", flush=True)
    metrics = [f"gateway {cluster.url}/metrics", f"scheduler :{cluster.cfg.scheduler.metrics_port}/metrics"]
    metrics += [f"{i.id} :{i.metrics_port}/metrics" for i in cluster.cfg.instances]
    print(f"pdd: Prometheus metrics: {', '.join(metrics)}", flush=True)
    if throwaway:
        print(f"pdd: throwaway CA and one bundle of credentials per process in {cluster.cfg.secrets_dir}", flush=True)
    try:
        supervise(
            cluster,
            stop,
            lambda: write_state(cluster.url, cluster.cfg.port, cluster.config_path, cluster.server_pids()),
        )
    finally:
        state.unlink(missing_ok=True)
        cluster.stop()
    return 0
