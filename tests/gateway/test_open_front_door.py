"""A gateway with no API keys is the one-host demo's: on any address but loopback it refuses to
start (an open gateway lets anyone force plans and read the whole `pdd` object), unless the
config says that is meant (`gateway.allow_open`)."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.gateway import Gateway
from shared.config import ConfigError, load_config


def _config(host: str, allow_open: bool = False):
    cfg = load_config(None)
    return dataclasses.replace(cfg, host=host, gateway=dataclasses.replace(cfg.gateway, allow_open=allow_open))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "pdd-a.example.net"])
def test_an_open_gateway_on_a_reachable_address_refuses_to_start(host, monkeypatch):
    monkeypatch.delenv("PDD_API_KEYS", raising=False)
    monkeypatch.delenv("PDD_ADMIN_KEYS", raising=False)
    with pytest.raises(ConfigError, match="no API keys configured and listening on .*PDD_API_KEYS"):
        Gateway(_config(host))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_an_open_gateway_on_loopback_starts(host, monkeypatch):
    monkeypatch.delenv("PDD_API_KEYS", raising=False)
    monkeypatch.delenv("PDD_ADMIN_KEYS", raising=False)
    assert Gateway(_config(host)).keys.open


def test_keys_or_a_deliberate_allow_open_let_it_start_anywhere(monkeypatch):
    monkeypatch.delenv("PDD_ADMIN_KEYS", raising=False)
    monkeypatch.delenv("PDD_API_KEYS", raising=False)
    assert Gateway(_config("0.0.0.0", allow_open=True)).keys.open
    monkeypatch.setenv("PDD_API_KEYS", "sk-one")
    assert not Gateway(_config("0.0.0.0")).keys.open
