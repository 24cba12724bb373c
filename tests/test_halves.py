"""`make test` runs the suite as two pytest processes at once (tests/halves.py): the halves must
split the suite exactly (no test in both, none in neither), the end-to-end tests on the shared
`cluster` in one, and the run's status must be the worse half's."""

from __future__ import annotations

import pytest

from tests import background
from tests.halves import NO_TESTS, ROOT, combined

# a file with tests on the shared `cluster` and one on the fleet, a file of unit tests, and one of
# the unit tests run beside the cluster's (tests/conftest.py `CLUSTER_HALF_FILES`)
FILES = [
    str(ROOT / f) for f in ("tests/cluster/test_abort.py", "tests/test_layers.py", "tests/runtime/test_reference.py")
]


class _Collected:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    def pytest_collection_finish(self, session) -> None:
        self.ids = {item.nodeid for item in session.items}


def _collected(*args: str) -> set[str]:
    """The test ids a run with `args` selects (collected here, in this process: nothing runs)."""
    seen = _Collected()
    code = pytest.main(
        ["--collect-only", "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}", *args, *FILES], plugins=[seen]
    )
    assert code == 0, code
    return seen.ids


def test_the_halves_split_the_suite_exactly(monkeypatch):
    stopped = []  # the inner sessions must not end this one's background jobs and clusters
    monkeypatch.setattr(background, "stop_all", lambda: stopped.append(True))
    everything, rest, cluster = _collected(), _collected("--half=rest"), _collected("--half=cluster")
    assert not stopped
    assert rest.isdisjoint(cluster)
    assert rest | cluster == everything
    abort, reference = "tests/cluster/test_abort.py::", "tests/runtime/test_reference.py::"
    assert cluster and all(i.startswith((abort, reference)) for i in cluster), cluster
    assert any(i.startswith(reference) for i in cluster) and not any(i.startswith(reference) for i in rest)
    assert abort + "test_a_stream_that_fails_ends_with_an_error_event" in rest  # the fleet's
    assert any(i.startswith("tests/test_layers.py::") for i in rest)


def test_the_run_fails_when_either_half_fails():
    assert combined({"rest": 0, "cluster": 0}) == 0
    assert combined({"rest": 0, "cluster": 1}) == 1
    assert combined({"rest": 2, "cluster": 0}) == 2  # interrupted
    assert combined({"rest": 0, "cluster": NO_TESTS}) == 0  # `-k` matched one half only
    assert combined({"rest": 1, "cluster": NO_TESTS}) == 1
    assert combined({"rest": NO_TESTS, "cluster": NO_TESTS}) == NO_TESTS
