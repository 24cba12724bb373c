"""Run the runtime tests on another device: `PDD_TEST_DEVICE=cuda pytest tests/runtime` (default cpu).

The models under test (`tiny`, `smol`) move to the device, so every engine built around them has
its pool and attention there; the references that `generate()` runs stay plain CPU models, so a
passing test says the device runtime reproduces transformers on the CPU token for token.
With the default (cpu) nothing here overrides tests/conftest.py.
"""

from __future__ import annotations

import os

import pytest

from shared.runtime.models import load_model, tiny_llama
from tests.helpers import reference_model

DEVICE = os.environ.get("PDD_TEST_DEVICE", "cpu")

if DEVICE != "cpu":

    @pytest.fixture(scope="session")
    def tiny():
        return tiny_llama().to(DEVICE)

    @pytest.fixture(scope="session")
    def tiny_ref():
        return reference_model(tiny_llama())

    @pytest.fixture(scope="session")
    def smol(smol_dir):
        return load_model(smol_dir, device=DEVICE)

    @pytest.fixture(scope="session")
    def smol_ref(smol_dir):
        return reference_model(load_model(smol_dir))
