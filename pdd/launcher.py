"""One-host launcher: NATS, Redis, the WAN emulator and every service as child processes.

`pdd up` runs `Cluster(...).start()` and waits for Ctrl-C; the tests and `pdd bench` use the
same class, so there is one way to bring a cluster up. Each child logs to
`<run_dir>/<name>.log`; stopping sends SIGTERM to every child, then SIGKILL to any left, so
no process outlives the cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from pdd.servers import EmbeddedServer, die_with_parent, free_port
from shared.config import ClusterConfig, config_from_dict, load_config, to_dict

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: str
    argv: tuple[str, ...]


def plan_processes(cfg: ClusterConfig, config_path: str) -> list[ProcessSpec]:
    """Every service process of the cluster, in start order (docker-compose mirrors this)."""

    def spec(name: str, role: str, *extra: str) -> ProcessSpec:
        return ProcessSpec(name, role, ("pdd", "serve", role, "--config", config_path, *extra))

    specs = [spec("wanlink", "wanlink")] if cfg.wan.enabled else []
    specs.append(spec("scheduler", "scheduler"))
    specs += [spec(i.id, i.role, "--instance", i.id) for i in cfg.instances]
    specs.append(spec("gateway", "gateway"))
    return specs


def serve_argv(role: str, config_path: str | None, instance: str | None) -> list[str]:
    argv = [sys.executable, "-m", f"services.{role}"]
    if config_path:
        argv += ["--config", config_path]
    if instance:
        argv += ["--instance", instance]
    return argv


def serve_one(role: str, config_path: str | None, instance: str | None) -> int:
    """`pdd serve ROLE`: become that service (per-datacenter deployment)."""
    argv = serve_argv(role, config_path, instance)
    os.chdir(ROOT)
    os.execv(argv[0], argv)


class Cluster:
    def __init__(self, config: str | Path | dict | None = None, log=print, **overrides: Any) -> None:
        if isinstance(config, dict):
            self.cfg = config_from_dict(config, **overrides)
        else:
            self.cfg = load_config(config, **overrides)
        self.log = log
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdd-cluster-"))
        self.servers: dict[str, EmbeddedServer] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ProcessSpec] = {}
        self.config_path = str(self.run_dir / "config.yaml")
        self.wan_port = 0

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    # -- start ----------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> Cluster:
        if self.procs:
            raise RuntimeError("cluster already started (`with Cluster(...)` starts it; do not also call start())")
        try:
            self._start_servers()
            for spec in plan_processes(self.cfg, self.config_path):
                self.specs[spec.name] = spec
                self.start_process(spec.name)
                if spec.role == "wanlink":
                    self._register_wan_route(timeout)
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.log(f"pdd: cluster ready at {self.url} (logs in {self.run_dir})")
        return self

    def _start_servers(self) -> None:
        settings = to_dict(self.cfg)
        for kind in ("nats", "redis"):
            if not settings[f"{kind}_url"]:
                self.log(f"pdd: starting embedded {kind} server")
                self.servers[kind] = EmbeddedServer(kind).start()
                settings[f"{kind}_url"] = self.servers[kind].url
        if settings["port"] == 0:
            settings["port"] = free_port()
        self.cfg = config_from_dict(settings)
        Path(self.config_path).write_text(yaml.safe_dump(settings, sort_keys=False))

    def start_process(self, name: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            # PR_SET_PDEATHSIG fires when the forking thread exits: the child would die with it
            raise RuntimeError(f"start {name} from the main thread; a child of another thread dies with it")
        spec = self.specs[name]
        extra = ["--ready-file", str(self.run_dir / "wanlink.port")] if spec.role == "wanlink" else []
        argv = serve_argv(spec.role, self.config_path, None) + list(spec.argv[5:]) + extra
        logf = open(self.run_dir / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDD_NATS_URL": self.cfg.nats_url,
               "PDD_REDIS_URL": self.cfg.redis_url, "PDD_PORT": str(self.cfg.port)}  # fmt: skip
        self.log(f"pdd: starting {name}")
        self.procs[name] = subprocess.Popen(
            argv, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            preexec_fn=die_with_parent,
        )
        logf.close()

    def _register_wan_route(self, timeout: float) -> None:
        ready = self.run_dir / "wanlink.port"
        self._until(lambda: ready.exists() and ready.read_text().strip(), timeout, "wanlink to listen", "wanlink")
        self.wan_port = int(ready.read_text().strip())
        r = redis.Redis.from_url(self.cfg.redis_url)
        r.set(f"pdd:route:{self.cfg.wan.src_dc}:{self.cfg.wan.dst_dc}", f"{self.cfg.host}:{self.wan_port}")
        r.close()

    def _wait_ready(self, timeout: float) -> None:
        def healthy() -> bool:
            try:
                return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        self._until(healthy, timeout, "the gateway to report every role alive")

    def _until(self, predicate, timeout: float, what: str, watch: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if (watch is None or name == watch) and proc.poll() is not None:
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
        try:
            for proc in self.procs.values():
                if proc.poll() is None:
                    _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for proc in self.procs.values():
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
        finally:
            for server in self.servers.values():
                server.close()
            self.procs.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # already gone
        pass


def run_cluster(config_path: str | None) -> int:
    cluster = Cluster(config_path)
    stop = {"now": False}

    def on_signal(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cluster.start()
    print(f"PDD serving on {cluster.url}  (OpenAI API: {cluster.url}/v1; Ctrl-C stops everything)", flush=True)
    try:
        while not stop["now"]:
            for name, proc in cluster.procs.items():
                if proc.poll() is not None:
                    print(f"pdd: {name} exited with {proc.returncode}; stopping", file=sys.stderr)
                    stop["now"] = True
            time.sleep(0.5)
    finally:
        cluster.stop()
    return 0
