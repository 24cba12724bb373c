from __future__ import annotations

import pytest
import torch

from shared.runtime.models import load_model, load_tokenizer, tiny_llama
from shared.runtime.provision import provision_default_model
from tests.helpers import reference_model

torch.set_num_threads(2)


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


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: launch only what the selected tests need
def pytest_collection_modifyitems(session, config, items):
    """Unit tests first, the slow end-to-end ones last, and the clusters those need launched
    now, so they boot while the unit tests run (tests/cluster/conftest.py)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: file order kept
    from tests.cluster.conftest import CLUSTERS, prelaunch

    wanted = {name for item in items for name in CLUSTERS if name in getattr(item, "fixturenames", ())}
    if wanted and not config.option.collectonly:
        prelaunch(wanted)


def pytest_sessionfinish(session, exitstatus):
    from tests.cluster.conftest import _launched

    for cluster in list(_launched.values()):  # launched for tests that did not run
        cluster.stop()
