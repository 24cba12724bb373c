"""The Kubernetes manifests (deploy/k8s/site-*/), checked without a cluster.

They must be what `python -m pdd.k8s` renders from configs/deploy.yaml today, run exactly the
processes the launcher plans for each site (as tests/test_compose.py holds the compose files to),
and be valid objects of a current Kubernetes: kubernetes-validate checks each against the API's
JSON schemas, bundled in the package (no network, no cluster).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from pdd import k8s
from pdd.certs import make_secrets, write_server_configs
from pdd.launcher import ROOT
from pdd.topology import ProcessSpec, plan_processes
from shared.config import ClusterConfig, ConfigError, config_from_dict, load_config

CONFIG = ROOT / "configs" / "deploy.yaml"
OUT = ROOT / "deploy" / "k8s"
RENDER = "python -m pdd.k8s --config configs/deploy.yaml --out deploy/k8s"
SITES = {"A": OUT / "site-a", "B": OUT / "site-b"}


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for var in [v for v in os.environ if v.startswith("PDD_")]:
        monkeypatch.delenv(var)


def objects(folder: Path) -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted(folder.glob("*.yaml")) if p.name != "kustomization.yaml"]


def of_kind(folder: Path, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects(folder) if o["kind"] == kind}


def pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def pdd_deployments(folder: Path) -> dict[str, dict]:
    return {n: d for n, d in of_kind(folder, "Deployment").items() if pod(d)["containers"][0]["image"] == k8s.IMAGE}


def planned(dc: str, cfg: ClusterConfig | None = None) -> list[ProcessSpec]:
    return [s for s in plan_processes(cfg or load_config(CONFIG), "/app/configs/deploy.yaml") if s.dc == dc]


def schema_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


def test_the_checked_in_manifests_are_a_fresh_render(tmp_path):
    assert k8s.main(["--config", str(CONFIG), "--out", str(tmp_path)]) == 0
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    kept = {p.relative_to(OUT): p.read_text() for p in OUT.rglob("*") if p.is_file()}
    stale = sorted(str(p) for p in fresh.keys() | kept.keys() if fresh.get(p) != kept.get(p))
    assert not stale, f"deploy/k8s differs from a fresh render in {stale}: re-render with `{RENDER}`"


def test_a_render_removes_objects_no_longer_planned_and_refuses_a_bad_config(tmp_path, capsys):
    (tmp_path / "site-a").mkdir()
    (tmp_path / "site-a" / "md-9.deployment.yaml").write_text("gone\n")
    assert k8s.main(["--config", str(CONFIG), "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "site-a" / "md-9.deployment.yaml").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("secrets_dir: /etc/pdd/secrets", "secrets_dir: ''"))
    assert k8s.main(["--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "secrets_dir" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("dc", SITES)
def test_each_site_runs_its_planned_processes_once_with_the_launchers_commands(dc):
    deployments, specs = pdd_deployments(SITES[dc]), planned(dc)
    assert sorted(deployments) == sorted(s.name for s in specs)  # each once, in its own site only
    for s in specs:
        (container,) = pod(deployments[s.name])["containers"]
        assert container["command"] == [str(a) for a in s.argv], s.name
        assert container["image"] == k8s.IMAGE  # the schema lets an image be left out: this does not


def test_the_sites_split_the_plan_with_nothing_left_over():
    everything = plan_processes(load_config(CONFIG), "/app/configs/deploy.yaml")
    names = [n for folder in SITES.values() for n in pdd_deployments(folder)]
    assert sorted(names) == sorted(s.name for s in everything)


def with_control_plane(**plane) -> ClusterConfig:
    return config_from_dict({**yaml.safe_load(CONFIG.read_text()), "control_plane": plane}, where="test")


def test_the_render_follows_the_plan_not_fixed_names():
    """Several gateways and schedulers are Deployments of their own names, on their own ports,
    all behind the one gateway Service."""
    cfg = with_control_plane(gateways=2, schedulers=2, ports={"gateway-1": 8001})
    rendered = {(o["kind"], o["metadata"]["name"]): o for o in k8s.site_objects(cfg, "deploy.yaml", "", "A")}
    deployments = {name for kind, name in rendered if kind == "Deployment"}
    assert deployments == {
        "nats-a",
        "redis",
        "prefill-0",
        "rld-0",
        "scheduler-0",
        "scheduler-1",
        "gateway-0",
        "gateway-1",
    }
    assert [s.name for s in planned("A", cfg) if s.role == "gateway"] == ["gateway-0", "gateway-1"]
    for name in ("gateway-0", "gateway-1"):
        (container,) = pod(rendered["Deployment", name])["containers"]
        assert container["ports"] == [{"name": "http", "containerPort": cfg.gateway_port(name)}]
    assert rendered["Service", "gateway"]["spec"]["ports"][0]["targetPort"] == "http"
    assert ("Deployment", "gateway") not in rendered
    assert all(schema_errors(o) == [] for o in rendered.values())


def test_what_is_not_rendered_yet_is_refused():
    for plane in ({"nats_servers": 3}, {"redis_replicas": 1, "sentinels": 3}, {"gateways": 2}):
        with pytest.raises(ConfigError):  # a second gateway without its port fixed, too
            k8s.site_objects(with_control_plane(**plane), "deploy.yaml", "", "A")


@pytest.mark.parametrize("dc", SITES)
def test_every_manifest_is_a_valid_kubernetes_object(dc):
    for obj in objects(SITES[dc]):
        assert schema_errors(obj) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def _replicas_as_text(d):
    d["spec"]["replicas"] = "two"


def _a_misspelt_field(d):
    d["spec"]["replica"] = 1


def _a_container_without_a_name(d):
    del pod(d)["containers"][0]["name"]


def _a_port_as_text(d):  # the schemas hold types, not ranges: 70000 would pass
    pod(d)["containers"][0]["ports"] = [{"containerPort": "8000"}]


@pytest.mark.parametrize(
    "breakage", [_replicas_as_text, _a_misspelt_field, _a_container_without_a_name, _a_port_as_text]
)
def test_a_broken_manifest_is_rejected(breakage):
    broken = copy.deepcopy(of_kind(SITES["A"], "Deployment")["gateway"])
    assert schema_errors(broken) == []
    breakage(broken)
    assert schema_errors(broken) != []


def test_an_unknown_kind_is_no_silent_pass():
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Deploymnet"}, latest_version(), strict=True)


@pytest.mark.parametrize("dc", SITES)
def test_each_kustomization_lists_exactly_the_files_in_its_folder(dc):
    listed = yaml.safe_load((SITES[dc] / "kustomization.yaml").read_text())["resources"]
    present = [p.name for p in SITES[dc].glob("*.yaml") if p.name != "kustomization.yaml"]
    assert len(listed) == len(set(listed)) and sorted(listed) == sorted(present)


@pytest.mark.parametrize("dc", SITES)
def test_pods_read_the_config_where_their_command_names_it(dc):
    (config_map,) = of_kind(SITES[dc], "ConfigMap").values()
    assert config_map["data"] == {"deploy.yaml": CONFIG.read_text()}
    for d in pdd_deployments(SITES[dc]).values():
        (container,) = pod(d)["containers"]
        at = container["command"][container["command"].index("--config") + 1]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == at]
        (volume,) = [v for v in pod(d)["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] == "deploy.yaml"


def test_the_secret_holds_what_pdd_certs_writes_and_each_pod_mounts_only_its_own(tmp_path):
    """Every file a pod mounts is in its site's Secret, made by the documented command from the
    folder `pdd certs --server-configs` writes."""
    cfg = k8s.load_file_config(CONFIG)
    folder = make_secrets(cfg, tmp_path / "secrets")
    write_server_configs(cfg, folder)
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for dc, site in SITES.items():
        files = k8s.secret_files(cfg, dc)
        assert all((folder / p).is_file() for p in files.values()), dc
        assert k8s.secret_command(cfg, dc) in docs, f"docs/deploy.md: site {dc}'s command is not today's"
        for name, d in of_kind(site, "Deployment").items():
            (volume,) = [v["secret"] for v in pod(d)["volumes"] if "secret" in v]
            assert all(files[i["key"]] == Path(i["path"]) for i in volume["items"]), name
            assert volume["secretName"] == k8s.SECRET
            mounted = {i["path"] for i in volume["items"]}
            assert not any(p.startswith("kv/") and p not in (f"kv/{name}.pem", f"kv/{name}.key") for p in mounted), name
    assert "nats/B.key" not in {str(p) for p in k8s.secret_files(cfg, "A").values()}  # each site only its own


def selects(svc: dict, d: dict) -> bool:
    return svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_services_reach_their_pods_and_only_clients_and_the_wan_come_from_outside():
    cfg, exposed = load_config(CONFIG), {}
    for site in SITES.values():
        deployments = of_kind(site, "Deployment")
        for name, svc in of_kind(site, "Service").items():
            targets = [d for d in deployments.values() if selects(svc, d)]
            ports = {p["name"] for d in targets for c in pod(d)["containers"] for p in c["ports"]}
            assert targets and all(p["targetPort"] in ports or p["name"] in ports for p in svc["spec"]["ports"]), name
            if svc["spec"]["type"] == "LoadBalancer":
                exposed[name] = [p["port"] for p in svc["spec"]["ports"]]
    a = cfg.datacenter("A")
    assert exposed == {"gateway": [cfg.port], "nats-a-leaf": [a.leaf_port], "md-0": [cfg.instance("md-0").kv_port]}
    services_a = of_kind(SITES["A"], "Service")
    assert services_a["rld-0"]["spec"]["ports"][0]["port"] == cfg.instance("rld-0").kv_port  # as prefill dials it
    assert cfg.instance("rld-0").host == "rld-0" and {"nats-a", "redis"} <= services_a.keys()


def test_the_nats_servers_run_the_config_pdd_certs_wrote():
    cfg = load_config(CONFIG)
    for dc, site in SITES.items():
        (container,) = pod(of_kind(site, "Deployment")[f"nats-{dc.lower()}"])["containers"]
        assert container["args"] == ["nats-server", "-c", f"{cfg.secrets_dir}/nats-{dc}.conf"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "monitor"}
    (redis,) = pod(of_kind(SITES["A"], "Deployment")["redis"])["containers"]
    assert redis["args"] == ["redis-server", f"{cfg.secrets_dir}/redis.conf"]
    assert "redis" not in of_kind(SITES["B"], "Deployment")  # Redis stays in the scheduler's site
