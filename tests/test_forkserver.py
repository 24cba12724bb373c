"""The fork server (pdd/forkserver.py): a forked child runs as `python -m module` would, in a
session of its own, with exactly the environment it was given; exits, signals and the server's
own death are reported the way `subprocess.Popen` reports them."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from pdd.forkserver import GONE, ROOT, ForkServer
from tests.cluster.test_migration import until

MODULE = "tests.forkserver_child"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ForkServer({**os.environ, "SERVER_ONLY": "1"}, tmp_path_factory.mktemp("fs") / "forkserver.log")
    s.ping()  # answers once its imports are done
    yield s
    s.close()


def _log_line(path, prefix: str = "{") -> str:
    return next(line for line in path.read_text().splitlines() if line.startswith(prefix))


def test_a_child_runs_its_module_as_python_m_would(server, tmp_path):
    log = tmp_path / "child.log"
    env = {"PATH": os.environ["PATH"], "CHILD_ONLY": "yes"}
    child = server.spawn(MODULE, ["report", "7"], env, log)
    assert child.wait(60) == 7 and child.returncode == 7 and child.poll() == 7
    seen = json.loads(_log_line(log))
    assert seen["argv"] == ["report", "7"] and seen["main"] == "__main__"
    assert seen["env"] == env  # exactly what it was given: nothing of the server's (SERVER_ONLY)
    assert seen["cwd"] == str(ROOT)
    assert seen["ppid"] == server.proc.pid and seen["sid"] == seen["pid"] == child.pid
    assert seen["preloaded"]  # torch came with the fork, not imported again
    assert seen["comm"] == "pdd child"  # named after its log for ps and top
    assert log.read_text().endswith("atexit ran\n")  # it exits as the interpreter would


def test_wait_times_out_and_a_signal_to_the_group_is_reported_as_popen_does(server, tmp_path):
    log = tmp_path / "child.log"
    child = server.spawn(MODULE, ["sleep"], {"PATH": os.environ["PATH"]}, log)
    until(lambda: log.exists() and "sleeping" in log.read_text(), 60, "the child to start")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL


def test_a_child_that_fails_to_start_exits_1_with_its_traceback_in_its_log(server, tmp_path):
    log = tmp_path / "child.log"
    child = server.spawn("tests.no_such_module", [], {"PATH": os.environ["PATH"]}, log)
    assert child.wait(60) == 1
    assert "No module named tests.no_such_module" in log.read_text()
    assert server.alive()  # the server itself goes on
    with pytest.raises(RuntimeError, match="not one of ours"):
        server.reap(1)


def test_children_get_sigterm_when_the_server_exits(tmp_path):
    server = ForkServer(dict(os.environ), tmp_path / "forkserver.log", preload=())
    log = tmp_path / "child.log"
    child = server.spawn(MODULE, ["sleep"], {"PATH": os.environ["PATH"]}, log)
    until(lambda: log.exists() and "sleeping" in log.read_text(), 60, "the child to start")
    server.close()  # end of its input: the launcher is done
    assert not server.alive()
    assert child.wait(10) == GONE  # it died with the server (SIGTERM); its status went with it


def test_services_get_sleeping_openmp_threads_unless_the_caller_chose(monkeypatch):
    """Every instance on a host has its own OpenMP pool; spinning idle threads burn the cores a
    busy instance needs, and threads that sleep at once make a second one useless, so the launcher
    gives the services (and the fork server they come from) a passive wait after a short spin,
    and keeps a wait the caller chose (shared/cores.py)."""
    from pdd.launcher import child_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = child_env()
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"]) == ("PASSIVE", "10000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = child_env()
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env  # it would override ACTIVE
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    env = child_env()
    assert env["GOMP_SPINCOUNT"] == "0" and "OMP_WAIT_POLICY" not in env
