from __future__ import annotations

import pytest

from services.prefill.service import Prefiller
from shared.config import config_from_dict
from shared.runtime.worker import EngineWorker
from tests.decoder.harness import CONFIG, engine
from tests.fakes import InMemoryNats


@pytest.fixture
async def prefill(tiny):
    """prefill-0 on a real engine thread, answering on an in-memory bus; `.nats` is that bus."""
    cfg = config_from_dict(CONFIG)
    service = Prefiller(cfg, cfg.instance("prefill-0"))
    service.nats = InMemoryNats()
    await service.start(service.nats.client("prefill-0"), EngineWorker(engine(tiny), service.on_outputs))
    yield service
    await service.shutdown()  # stops the engine thread too
