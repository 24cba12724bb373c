from __future__ import annotations

import logging
import os

# Set before torch loads OpenMP, and inherited by every process the suite starts. A test run's
# processes share 2 cores (the two halves, background jobs, clusters booting, references computed
# here), and OpenMP's default of spinning ~3 ms while it waits burns the core another process
# needs: beside one busy process, tests/runtime/test_equivalence.py took 95 s (110 s of CPU)
# spinning and 48 s (44 s) waiting passively; alone, 40-45 s either way. The launcher's short spin
# (shared/cores.py), a gain where the instances have the host to themselves, costs here, where
# they never do: the shipped fleet's mixed-precision burst test took 110 s with it beside a busy
# core, 58 s without (42 s and 52 s on a quiet host). Set here, the launcher adds no spin.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from shared.runtime.models import load_model, load_tokenizer, tiny_llama
from shared.runtime.provision import provision_default_model
from tests import background
from tests.halves import HALVES
from tests.helpers import reference_model

torch.set_num_threads(2)


@pytest.fixture
def refusals(caplog):
    """The KV plane's warnings so far (shared.kv_send, shared.kv_receive): each refusal is one."""
    caplog.set_level(logging.WARNING, logger="shared")
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith("shared.kv_")]


@pytest.fixture(scope="session")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_ref(tiny):
    return reference_model(tiny)


@pytest.fixture(scope="session")
def smol_dir():
    return provision_default_model()


@pytest.fixture(scope="session")
def smol(smol_dir):
    return load_model(smol_dir)


@pytest.fixture(scope="session")
def smol_ref(smol):
    return reference_model(smol)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    return load_tokenizer(smol_dir)


def pytest_addoption(parser):
    parser.addoption(
        "--half",
        choices=HALVES,
        help="run one half of the suite: the end-to-end tests on the shared `cluster` session cluster, "
        "or the rest; `make test` runs both at once (tests/halves.py)",
    )


# Unit tests that run beside the `cluster` session cluster's, to even the halves out: on 2 cores
# the cluster half took 514 s and the other 670 (the keyed and fleet clusters' tests and most unit
# tests), and the machine sat half idle while the longer one finished. These three files' model
# runs took ~75 s of it.
CLUSTER_HALF_FILES = (
    "tests/runtime/test_equivalence.py",
    "tests/runtime/test_reference.py",
    "tests/runtime/test_invariant.py",
)


def half_of(clusters: list[str], path: str = "") -> str:
    """The tests on the `cluster` session cluster, and the unit tests of `CLUSTER_HALF_FILES`
    (`path`: a test's file, relative to the repository), are one half; every other test is the
    other."""
    return "cluster" if clusters[:1] == ["cluster"] or path in CLUSTER_HALF_FILES else "rest"


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: launch only what the selected tests need
def pytest_collection_modifyitems(session, config, items):
    """Unit tests first, then the slow end-to-end ones grouped by the session cluster they use
    (tests/cluster/conftest.py `CLUSTERS`, shortest group first), then the slow ones whose work
    is a process of their own. Those processes start now (tests/background.py) and run beside
    the unit tests; the clusters the selected tests need launch once they end, so they boot
    while the rest of the unit tests run, and each stops after the last test that uses it: the
    later tests share the machine with fewer idle ones. (On the 2-core VM this suite is timed
    on, the engines of a 3-engine cluster, started fresh rather than forked, took 4.7-4.9 s of
    CPU each to boot alone and 7.6-9.9 s beside the three idle session clusters.) With `--half`,
    only that half's tests are kept, and only its clusters and processes start."""
    from tests.cluster.conftest import CLUSTERS, launch_after_background

    def clusters_of(item) -> list[str]:
        return [name for name in CLUSTERS if name in getattr(item, "fixturenames", ())]

    if half := config.getoption("half"):

        def half_of_item(item) -> str:
            return half_of(clusters_of(item), item.nodeid.split("::")[0])

        kept = [item for item in items if half_of_item(item) == half]
        if dropped := [item for item in items if half_of_item(item) != half]:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept

    def group(item) -> tuple[int, int]:
        if item.get_closest_marker("slow") is None:
            return (0, 0)
        used = clusters_of(item)
        return (1, list(CLUSTERS).index(used[0]) if used else len(CLUSTERS))

    items.sort(key=group)  # stable: file order kept within a group
    last_user: dict[str, str] = {}
    for item in items:
        last_user |= dict.fromkeys(clusters_of(item), item.nodeid)
    stop_after: dict[str, list[str]] = {}
    for name, nodeid in last_user.items():
        stop_after.setdefault(nodeid, []).append(name)
    config.stash[_STOP_AFTER] = stop_after
    if config.option.collectonly:
        return
    for item in items:
        if marker := item.get_closest_marker("background"):
            background.start(marker.args[0])
    launch_after_background(set(last_user))


def pytest_runtest_setup(item):
    from tests.cluster.conftest import launch_waiting

    launch_waiting()  # the session clusters, once the background processes have ended


@pytest.fixture
def background_job(request):
    """The test's background process (`@pytest.mark.background.with_args(command)`), finished:
    (subprocess.CompletedProcess, the folder it wrote to)."""
    (marker,) = request.node.iter_markers("background")
    return background.result(marker.args[0])


_STOP_AFTER = pytest.StashKey[dict]()  # test id -> the clusters it is the last to use


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures are torn down: stop the clusters it was the last to use
    from tests.cluster.conftest import release

    for name in item.config.stash.get(_STOP_AFTER, {}).get(item.nodeid, ()):
        release(name)


def pytest_sessionfinish(session, exitstatus):
    if session.config.option.collectonly:  # started nothing (tests/test_halves.py collects in a running session)
        return
    from tests.cluster.conftest import _launched

    background.stop_all()
    for cluster in list(_launched.values()):  # launched for tests that did not run
        cluster.stop()
