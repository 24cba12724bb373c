"""`make test`: the whole suite as its two halves (`--half`, tests/conftest.py), each a pytest
process of its own, run at the same time; the exit status is the worse of the two.

Why: run in one process, the end-to-end tests kept a 2-core machine only ~55% busy: most of them
drive one or two requests at a time through one cluster and wait on the line, a heartbeat or a
stream. The tests on the shared `cluster` (`tests/cluster/conftest.py`) and a few model unit
tests (`CLUSTER_HALF_FILES`) are one half, everything else (unit tests, the keyed and fleet
clusters' tests, the benches' own processes) the other;
side by side they keep both cores busy, and the two took 378 and 387 s where one process took
567 s, on the same machine in the same hour. The tests hold: each end-to-end test already
follows the pace of the machine it runs on (README, "Tests"), and the other half is one more
load on it. `python -m pytest` still runs the whole suite in one process.

    python -m tests.halves [pytest arguments]   # e.g. -q -ra --durations=25
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdd.servers import die_with_parent

HALVES = ("rest", "cluster")  # `--half` (tests/conftest.py `half_of`)

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS = 5  # pytest's exit status when nothing was selected (say, `-k` matched one half only)


def combined(codes: dict[str, int]) -> int:
    """The run's exit status: the worse half's, where a half with nothing selected counts only
    when neither half ran a test."""
    ran = [code for code in codes.values() if code != NO_TESTS]
    return max(ran, default=NO_TESTS)


def main(args: list[str]) -> int:
    start = time.monotonic()
    lock = threading.Lock()

    def relay(half: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # each line as it completes: a line of -q's dots is 80 tests
            with lock:
                sys.stdout.write(f"[{half}] {line}")
                sys.stdout.flush()

    procs = {
        half: subprocess.Popen(
            [sys.executable, "-m", "pytest", f"--half={half}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            cwd=ROOT,
            start_new_session=True,  # a Ctrl-C reaches them once, from here (below)
            preexec_fn=die_with_parent,  # a killed `make test` takes its halves (and their servers) along
        )
        for half in HALVES
    }
    relays = [threading.Thread(target=relay, args=item, daemon=True) for item in procs.items()]
    for t in relays:
        t.start()
    try:
        codes = {half: proc.wait() for half, proc in procs.items()}
    except KeyboardInterrupt:  # pass it on, then let the halves stop their servers and report
        for proc in procs.values():
            proc.send_signal(signal.SIGINT)
        codes = {half: proc.wait() for half, proc in procs.items()}
    for t in relays:
        t.join()
    status = combined(codes)
    verdict = {0: "passed", NO_TESTS: "no test selected"}.get(status, "FAILED")
    print(
        f"\n{verdict}: "
        + ", ".join(f"half {h!r} exit status {c}" for h, c in codes.items())
        + f"; {time.monotonic() - start:.0f} s in all"
    )
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
