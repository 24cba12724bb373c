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
