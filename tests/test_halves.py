"""`make test` runs the suite as two pytest processes at once (tests/halves.py): the halves must
split the suite exactly (no test in both, none in neither), the end-to-end tests on the shared
`cluster` in one, and the run's status must be the worse half's."""

from __future__ import annotations

import subprocess
import sys

from tests.halves import NO_TESTS, ROOT, combined

# a file with tests on the shared `cluster` and one on the fleet, and a file of unit tests
FILES = ["tests/cluster/test_abort.py", "tests/test_layers.py"]


def _collected(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args, *FILES],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_the_halves_split_the_suite_exactly():
    runs = {
        name: _collected(*args)
        for name, args in {"all": [], "rest": ["--half=rest"], "cluster": ["--half=cluster"]}.items()
    }
    ids = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        ids[name] = {line for line in out.splitlines() if "::" in line}
    assert ids["rest"].isdisjoint(ids["cluster"])
    assert ids["rest"] | ids["cluster"] == ids["all"]
    abort = "tests/cluster/test_abort.py::"
    assert ids["cluster"] and all(i.startswith(abort) for i in ids["cluster"]), ids["cluster"]
    assert abort + "test_a_stream_that_fails_ends_with_an_error_event" in ids["rest"]  # the fleet's
    assert any(i.startswith("tests/test_layers.py::") for i in ids["rest"])


def test_the_run_fails_when_either_half_fails():
    assert combined({"rest": 0, "cluster": 0}) == 0
    assert combined({"rest": 0, "cluster": 1}) == 1
    assert combined({"rest": 2, "cluster": 0}) == 2  # interrupted
    assert combined({"rest": 0, "cluster": NO_TESTS}) == 0  # `-k` matched one half only
    assert combined({"rest": 1, "cluster": NO_TESTS}) == 1
    assert combined({"rest": NO_TESTS, "cluster": NO_TESTS}) == NO_TESTS
