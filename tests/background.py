"""Slow tests whose work is one process of their own (`pdd bench` with its clusters, the GPU-check
script) start that process when the session starts, so it runs beside the unit tests; the test
itself waits for it and asserts on what it did. Neither process's checks measure time.

A test names its command with `@pytest.mark.background.with_args(command)` (a bare callable
argument would be taken for the function to mark), where `command(out)` returns the argv and
extra environment for a process that writes its files under `out`; the test takes the
`background_job` fixture (tests/conftest.py): the finished process (returncode, stdout,
stderr) and `out`.

The session clusters (tests/cluster/conftest.py) launch once every background process has
ended, or when a test needs one, after waiting for them: no end-to-end test of the same pytest
process shares the machine with them, and their memory (a bench runs clusters of its own) never
adds to that process's clusters'. (`make test` runs a second process beside this one, the other
half of the suite: tests/halves.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdd.servers import die_with_parent

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600.0
Command = Callable[[Path], tuple[list[str], dict[str, str]]]


@dataclass
class Job:
    proc: subprocess.Popen
    out: Path
    started: float

    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self) -> None:
        try:
            self.proc.wait(max(1.0, self.started + TIMEOUT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def result(self) -> tuple[subprocess.CompletedProcess, Path]:
        self.wait()
        stdout, stderr = ((self.out / f"{name}.log").read_text() for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout, stderr), self.out


_jobs: dict[Command, Job] = {}


def start(command: Command) -> None:
    """From the main thread (the process gets SIGTERM if the thread that started it ends)."""
    if command in _jobs:
        return
    out = Path(tempfile.mkdtemp(prefix="pdd-test-job-"))
    argv, env = command(out)
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, **env},
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    _jobs[command] = Job(proc, out, time.monotonic())


def all_done() -> bool:
    return all(job.done() for job in _jobs.values())


def wait_all() -> None:
    for job in _jobs.values():
        job.wait()


def result(command: Command) -> tuple[subprocess.CompletedProcess, Path]:
    start(command)  # not started at collection (a test run by itself under a plugin that reorders)
    return _jobs[command].result()


def stop_all() -> None:
    """At the session's end: a job whose test did not run (interrupted) ends too, and every
    job's folder goes (a failing test printed what it needed)."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGTERM)
            job.wait()
        shutil.rmtree(job.out, ignore_errors=True)
    _jobs.clear()
