"""A fork server for the service processes one launcher starts on its host.

Every service process begins the same way: import torch, transformers, FastAPI and our own
modules. That is ~2.8 s of one core's time before an engine is built, about 60% of an engine's
boot, and the host pays it again for every process and for every restart. The fork server pays
it once: it imports all of them, then forks a child for each service and the child runs the
service's `__main__` exactly as `python -m services.<role>` would (Python's own `forkserver`
start method and gunicorn's `preload_app` do the same). The imported code's pages stay shared
between the children.

Protocol: the launcher writes one JSON request per line on the server's stdin and reads one
reply per line from its stdout; a lock keeps request and reply together.
- `{"op": "spawn", "module", "args", "env", "cwd", "log"}` -> `{"pid"}`: the child starts a
  session of its own (so `killpg(pid)` reaches it and its children), gets SIGTERM if the server
  dies (`die_with_parent`), writes stdout and stderr to `log`, and sees exactly `env`.
- `{"op": "ping"}` -> `{"pid"}`: the server has done its imports.
- `{"op": "reap", "pid"}` -> `{"code"}`: its exit status as `Popen.returncode` gives it (-N for
  signal N), or null while it runs. The server is the children's parent, so only it can reap.
End of input: the launcher is gone or done; the server exits, and any child still running gets
SIGTERM. The server itself gets SIGTERM if the launcher dies.

Limits: what the interpreter or a native library reads from the environment at start-up
(`PYTHON*`, `MALLOC_*`, `OMP_*`) is the server's, i.e. the launcher's when the server started;
the launcher starts it with the same additions it gives every child. A CUDA context does not
survive fork, so a cluster on a GPU starts each service fresh (`Cluster.start_process`); the
server imports torch but never touches a device.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import select
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from pdd.servers import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = (
    "torch",
    "transformers",
    "services.gateway.app",
    "services.scheduler.service",
    "services.wanlink.link",
    "services.prefill.service",
    "services.rld.service",
    "services.md.service",
)
GONE = 255  # the exit status of a child whose fork server died before reporting it


class ForkServerGone(RuntimeError):
    pass


class ForkServer:
    """The launcher's side: one server process, shared by every cluster this process starts."""

    def __init__(self, env: dict[str, str], log_path: Path, preload: tuple[str, ...] = PRELOAD) -> None:
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdd.forkserver", *preload],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.log_path = log_path
        self._lock = threading.Lock()

    def spawn(self, module: str, args: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
        """Start `python -m module *args` as a child of the server (the first call waits for the
        server's imports)."""
        reply = self._ask(op="spawn", module=module, args=args, env=env, cwd=str(ROOT), log=str(log_path))
        return ForkedProcess(self, reply["pid"])

    def ping(self) -> None:
        """Returns once the server has done its imports and answers."""
        self._ask(op="ping")

    def reap(self, pid: int) -> int | None:
        try:
            return self._ask(op="reap", pid=pid)["code"]
        except ForkServerGone:  # and its children got SIGTERM with it
            return None if _running(pid) else GONE

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def _ask(self, **request) -> dict:
        with self._lock:
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except (BrokenPipeError, ValueError):  # ValueError: closed
                line = b""
        if not line:
            raise ForkServerGone(f"the fork server exited ({self.proc.poll()}); see {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"fork server: {reply['error']}")
        return reply


class ForkedProcess:
    """A service the fork server started, with the part of `subprocess.Popen` the launcher uses:
    `pid`, `returncode`, `poll()`, `wait(timeout)`."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None
        try:  # readable once the process exits: waits without polling (Linux 5.3+)
            self._exit_fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._exit_fd = None

    def poll(self) -> int | None:
        if self.returncode is None and self._may_have_exited():
            self.returncode = self.server.reap(self.pid)
            if self.returncode is not None and self._exit_fd is not None:
                os.close(self._exit_fd)
                self._exit_fd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            if self._exit_fd is not None:
                select.select([self._exit_fd], [], [], min(left, 1.0))
            else:
                time.sleep(min(left, 0.05))
        return self.returncode

    def _may_have_exited(self) -> bool:
        """False only when it surely runs: no need to ask the server."""
        return self._exit_fd is None or bool(select.select([self._exit_fd], [], [], 0)[0])

    def __del__(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- the server process -----------------------------------------------------------------------
def serve(requests, replies) -> dict | None:
    """Answer requests until end of input (returns None). In a forked child it returns that
    child's spawn request instead, so the child leaves this loop and runs its service."""
    ours = os.getpid()
    done: dict[int, int] = {}
    for line in requests:
        request = json.loads(line)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                return {**request, "server": ours}
            reply: dict = {"pid": pid}
        elif request["op"] == "ping":
            reply = {"pid": ours}
        elif request["op"] == "reap":
            pid = request["pid"]
            try:
                if pid not in done:
                    reaped, status = os.waitpid(pid, os.WNOHANG)
                    if reaped:
                        done[pid] = os.waitstatus_to_exitcode(status)
                reply = {"code": done.get(pid)}
            except ChildProcessError:
                reply = {"error": f"pid {pid} is not one of ours"}
        else:
            reply = {"error": f"unknown op {request['op']!r}"}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()
    return None


def run_child(request: dict, channel: list) -> int:
    """Become the requested service: `python -m module *args`, as if started fresh."""
    os.setsid()
    die_with_parent()
    if os.getppid() != request["server"]:  # the server died before the line above
        os._exit(GONE)
    for f in channel:
        f.close()
    _name_process(f"pdd {Path(request['log']).stem}")  # `ps -o comm` and top: "pdd md-0", not "python"
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _name_process(name: str) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def exit_now(code: int) -> None:
    """Exit as the interpreter would, less tearing every module down: with torch imported (as
    in every child here) that costs ~1 s of CPU and holds up a cluster's stop."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    # the channel moves off fds 0 and 1, so nothing an import prints can corrupt it
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    for name in sys.argv[1:]:  # the modules to preload
        __import__(name)
    request = serve(requests, replies)
    if request is None:  # skip tearing down torch's interpreter (~1 s of CPU) as services do
        os._exit(0)
    sys.stdout.reconfigure(line_buffering=True)  # as PYTHONUNBUFFERED would, for a log file
    exit_now(run_child(request, [requests, replies]))


if __name__ == "__main__":
    main()
