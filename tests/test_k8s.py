"""The Kubernetes manifests (deploy/k8s/site-*/, and deploy/k8s-ha/site-*/ for the replicated
control plane), checked without a cluster.

They must be what `python -m pdd.k8s` renders from configs/deploy.yaml (configs/deploy-ha.yaml)
today, run exactly the processes the launcher plans for each site (as tests/test_compose.py holds
the compose files to), and be valid objects of a current Kubernetes: kubernetes-validate checks
each against the API's JSON schemas, bundled in the package (no network, no cluster). The HA
render's servers must find each other by the Services rendered: the NATS routes, the Redis
replicas' primary, the Sentinels' primary and the clients' Sentinels.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from kubernetes_validate.utils import latest_version

from pdd import k8s
from pdd.certs import make_secrets, write_server_configs
from pdd.launcher import ROOT
from pdd.redisconf import REDIS_USERS
from pdd.topology import ProcessSpec, plan_processes
from shared.config import ClusterConfig, ConfigError, config_from_dict, load_config
from shared.security import bundle_name, site_bundle


@dataclass(frozen=True)
class Render:
    """A config and the folders rendered from it."""

    config: Path
    out: Path

    @property
    def sites(self) -> dict[str, Path]:
        return {"A": self.out / "site-a", "B": self.out / "site-b"}

    @property
    def command(self) -> str:
        return f"python -m pdd.k8s --config {self.config.relative_to(ROOT)} --out {self.out.relative_to(ROOT)}"

    def cfg(self) -> ClusterConfig:
        return load_config(self.config)


PLAIN = Render(ROOT / "configs" / "deploy.yaml", ROOT / "deploy" / "k8s")
HA = Render(ROOT / "configs" / "deploy-ha.yaml", ROOT / "deploy" / "k8s-ha")
CONFIG, SITES = PLAIN.config, PLAIN.sites
BOTH = pytest.mark.parametrize("r", [PLAIN, HA], ids=["deploy", "deploy-ha"])
EACH_SITE = pytest.mark.parametrize(
    "r, dc",
    [(r, dc) for r in (PLAIN, HA) for dc in r.sites],
    ids=[f"{n}-{dc}" for n in ("deploy", "ha") for dc in "AB"],
)


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


def planned(dc: str, cfg: ClusterConfig, config_name: str = "deploy.yaml") -> list[ProcessSpec]:
    return [s for s in plan_processes(cfg, f"/app/configs/{config_name}") if s.dc == dc]


def schema_errors(obj: dict) -> list[str]:
    try:
        kubernetes_validate.validate(obj, latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    return []


@BOTH
def test_the_checked_in_manifests_are_a_fresh_render(tmp_path, r):
    assert k8s.main(["--config", str(r.config), "--out", str(tmp_path)]) == 0
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    kept = {p.relative_to(r.out): p.read_text() for p in r.out.rglob("*") if p.is_file()}
    stale = sorted(str(p) for p in fresh.keys() | kept.keys() if fresh.get(p) != kept.get(p))
    assert not stale, f"{r.out.relative_to(ROOT)} differs from a fresh render in {stale}: re-render with `{r.command}`"


def test_a_render_removes_objects_no_longer_planned_and_refuses_a_bad_config(tmp_path, capsys):
    (tmp_path / "site-a").mkdir()
    (tmp_path / "site-a" / "md-9.deployment.yaml").write_text("gone\n")
    assert k8s.main(["--config", str(CONFIG), "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "site-a" / "md-9.deployment.yaml").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("secrets_dir: /etc/pdd/secrets", "secrets_dir: ''"))
    assert k8s.main(["--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "secrets_dir" in capsys.readouterr().err and not (tmp_path / "x").exists()


@EACH_SITE
def test_each_site_runs_its_planned_processes_once_with_the_launchers_commands(r, dc):
    deployments, specs = pdd_deployments(r.sites[dc]), planned(dc, r.cfg(), r.config.name)
    assert sorted(deployments) == sorted(s.name for s in specs)  # each once, in its own site only
    for s in specs:
        (container,) = pod(deployments[s.name])["containers"]
        assert container["command"] == [str(a) for a in s.argv], s.name
        assert container["image"] == k8s.IMAGE  # the schema lets an image be left out: this does not


@BOTH
def test_the_sites_split_the_plan_with_nothing_left_over(r):
    everything = plan_processes(r.cfg(), f"/app/configs/{r.config.name}")
    names = [n for folder in r.sites.values() for n in pdd_deployments(folder)]
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


def _ha_without(change) -> ClusterConfig:
    raw = yaml.safe_load(HA.config.read_text())
    change(raw)
    return config_from_dict(raw, where="test")


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda raw: raw["control_plane"].pop("hosts"), "control_plane.hosts"),  # the routes would dial 127.0.0.1
        (lambda raw: raw["datacenters"]["A"].update(nats_url="nats://nats-a-0:4222"), "nats_url must list each"),
        (lambda raw: raw["control_plane"]["ports"].pop("redis-1"), "must fix redis-1's port"),
        (lambda raw: raw["control_plane"]["ports"].pop("sentinel-2"), "must fix sentinel-2's port"),
        (lambda raw: raw.pop("redis_sentinels"), "redis_sentinels '' must name"),  # clients would miss a failover
        (lambda raw: raw.update(redis_sentinels="sentinel-0:26379"), "sentinel-1:26379"),
        (lambda raw: raw["control_plane"]["ports"].pop("gateway-1"), "port must be fixed"),
    ],
)
def test_an_ha_plane_that_kubernetes_cannot_wire_up_is_refused(change, says):
    cfg = _ha_without(change)
    with pytest.raises(ConfigError, match=says):
        for dc in ("A", "B"):
            k8s.site_objects(cfg, "deploy-ha.yaml", "", dc)


@EACH_SITE
def test_every_manifest_is_a_valid_kubernetes_object(r, dc):
    for obj in objects(r.sites[dc]):
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


@EACH_SITE
def test_each_kustomization_lists_exactly_the_files_in_its_folder(r, dc):
    listed = yaml.safe_load((r.sites[dc] / "kustomization.yaml").read_text())["resources"]
    present = [p.name for p in r.sites[dc].glob("*.yaml") if p.name != "kustomization.yaml"]
    assert len(listed) == len(set(listed)) and sorted(listed) == sorted(present)


@EACH_SITE
def test_pods_read_the_config_where_their_command_names_it(r, dc):
    (config_map,) = of_kind(r.sites[dc], "ConfigMap").values()
    name = r.config.name
    assert config_map["data"] == {name: r.config.read_text()}
    for d in pdd_deployments(r.sites[dc]).values():
        (container,) = pod(d)["containers"]
        at = container["command"][container["command"].index("--config") + 1]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == at]
        (volume,) = [v for v in pod(d)["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == config_map["metadata"]["name"] and mount["subPath"] == name


def written(r: Render, tmp_path: Path) -> tuple[ClusterConfig, Path]:
    """The folder `pdd certs --server-configs` writes for `r`'s config."""
    cfg = k8s.load_file_config(r.config)
    folder = make_secrets(cfg, tmp_path / "secrets")
    write_server_configs(cfg, folder)
    return cfg, folder


def named_files(d: dict, secrets_dir: str) -> set[str]:
    """The files of the secrets folder that a Deployment's containers name on their command lines."""
    words = [
        w
        for c in pod(d).get("initContainers", []) + pod(d)["containers"]
        for w in c.get("command", []) + c.get("args", [])
    ]
    return {w.removeprefix(f"{secrets_dir}/") for w in words if w.startswith(f"{secrets_dir}/")}


SERVERS = ("nats", "redis", "sentinel")


def own_bundle(d: dict, dc: str) -> str:
    """The bundle a Deployment's pod should mount: its site's for a server, else its process's."""
    name, component = d["metadata"]["name"], d["metadata"]["labels"]["app.kubernetes.io/component"]
    return site_bundle(dc) if component in SERVERS else bundle_name(component, name)


@BOTH
def test_the_secret_holds_what_pdd_certs_writes_and_each_pod_mounts_only_its_own(tmp_path, r):
    """Every file a pod mounts is in its site's Secret, made by the command in the site's
    kustomization.yaml from the folder `pdd certs --server-configs` writes; each pod mounts files
    of its own bundle alone (a server's: its site's, and of the servers' configs only the one it
    runs), and a site's Secret holds no bundle of the other site's."""
    cfg, folder = written(r, tmp_path)
    for dc, site in r.sites.items():
        files = k8s.secret_files(cfg, dc)
        assert all((folder / p).is_file() for p in files.values()), dc
        assert sorted(str(p.relative_to(folder)) for p in folder.glob("site-*/*.conf")) == sorted(
            {str(p) for d in cfg.datacenters for p in k8s.secret_files(cfg, d.name).values() if p.suffix == ".conf"}
        )  # every config written is some site's
        how = "".join(f"#   {line}\n" for line in k8s.secret_command(cfg, dc).splitlines())
        assert how in (site / "kustomization.yaml").read_text()
        for name, d in of_kind(site, "Deployment").items():
            (volume,) = [v["secret"] for v in pod(d)["volumes"] if "secret" in v]
            assert volume["secretName"] == k8s.SECRET
            bundle = own_bundle(d, dc)
            assert all(files[i["key"]] == PurePosixPath(bundle, i["path"]) for i in volume["items"]), name
            mounted = {i["path"] for i in volume["items"]}
            assert {p for p in mounted if p.endswith(".conf")} == {
                f for f in named_files(d, cfg.secrets_dir) if f.endswith(".conf")
            }
        bundles = {p.parts[0] for p in files.values()}
        other = {i.id for i in cfg.instances if i.dc != dc} | {
            site_bundle(d.name) for d in cfg.datacenters if d.name != dc
        }
        assert bundles and not bundles & other, dc  # site A's Secret holds no key of md-0's
    assert "site-B/nats/B.key" not in {str(p) for p in k8s.secret_files(cfg, "A").values()}


def test_a_pod_mounting_another_bundle_is_caught():
    d = copy.deepcopy(of_kind(SITES["A"], "Deployment")["gateway"])
    (volume,) = [v["secret"] for v in pod(d)["volumes"] if "secret" in v]
    files = k8s.secret_files(PLAIN.cfg(), "A")
    assert all(files[i["key"]] == PurePosixPath(own_bundle(d, "A"), i["path"]) for i in volume["items"])
    volume["items"][0]["key"] = "prefill-0-kv-prefill-0.key"
    assert not all(files[i["key"]] == PurePosixPath(own_bundle(d, "A"), i["path"]) for i in volume["items"])


def test_docs_deploy_gives_each_sites_secret_command_of_today():
    cfg, docs = k8s.load_file_config(CONFIG), (ROOT / "docs" / "deploy.md").read_text()
    for dc in SITES:
        assert k8s.secret_command(cfg, dc) in docs, f"docs/deploy.md: site {dc}'s command is not today's"


def selects(svc: dict, d: dict) -> bool:
    return svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()


@BOTH
def test_services_reach_their_pods_and_only_clients_and_the_wan_come_from_outside(r):
    cfg, exposed = r.cfg(), {}
    for site in r.sites.values():
        deployments = of_kind(site, "Deployment")
        for name, svc in of_kind(site, "Service").items():
            targets = [d for d in deployments.values() if selects(svc, d)]
            ports = {p["name"] for d in targets for c in pod(d)["containers"] for p in c["ports"]}
            assert targets and all(p["targetPort"] in ports or p["name"] in ports for p in svc["spec"]["ports"]), name
            if svc["spec"]["type"] == "LoadBalancer":
                exposed[name] = [p["port"] for p in svc["spec"]["ports"]]
    services = k8s.nats_services(cfg, "A")
    leaves = {f"{services[s.name][0]}-leaf": [s.leaf_port] for s in cfg.nats_servers("A")}
    assert exposed == {"gateway": [cfg.port], **leaves, "md-0": [cfg.instance("md-0").kv_port]}
    a = cfg.datacenter("A")  # B's servers dial every leaf port, where leaf_host reaches them
    assert sorted(cfg.datacenter("B").leaf_remote.split(",")) == sorted(f"{a.leaf_host}:{p}" for [p] in leaves.values())
    services_a = of_kind(r.sites["A"], "Service")
    assert services_a["rld-0"]["spec"]["ports"][0]["port"] == cfg.instance("rld-0").kv_port  # as prefill dials it
    assert cfg.instance("rld-0").host == "rld-0" and {*(s for s, _ in services.values()), "redis"} <= services_a.keys()


@BOTH
def test_the_servers_run_the_configs_pdd_certs_wrote(tmp_path, r):
    cfg, folder = written(r, tmp_path)
    for dc, site in r.sites.items():
        for k, server in enumerate(cfg.nats_servers(dc)):
            service, _ = k8s.nats_services(cfg, dc)[server.name]
            (container,) = pod(of_kind(site, "Deployment")[service])["containers"]
            assert container["args"] == ["nats-server", "-c", f"{cfg.secrets_dir}/{server.name}.conf"]
            assert (folder / site_bundle(dc) / f"{server.name}.conf").is_file()
            probe = (
                {"httpGet": {"path": "/healthz", "port": "monitor"}} if k == 0 else {"tcpSocket": {"port": "client"}}
            )
            assert probe.items() <= container["readinessProbe"].items(), server.name  # monitor on the first only
    deployments = of_kind(r.sites["A"], "Deployment")
    for name in ["redis", *cfg.control_plane.replica_names]:
        (redis,) = pod(deployments[name])["containers"]
        assert (
            redis["args"] == ["redis-server", f"{cfg.secrets_dir}/{name}.conf"]
            and (folder / site_bundle("A") / f"{name}.conf").is_file()
        )
    assert not any(name.startswith(("redis", "sentinel")) for name in of_kind(r.sites["B"], "Deployment"))


def redis_conf(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip()]


def directive(conf: list[list[str]], *words: str) -> list[str]:
    """The arguments of the one line of `conf` that starts with `words`."""
    (found,) = [line[len(words) :] for line in conf if line[: len(words)] == list(words)]
    return found


def ports_of(svc: dict) -> dict[str, int]:
    return {p["name"]: p["port"] for p in svc["spec"]["ports"]}


def of_component(site: Path, component: str) -> dict[str, dict]:
    deployments = of_kind(site, "Deployment")
    return {n: d for n, d in deployments.items() if d["metadata"]["labels"]["app.kubernetes.io/component"] == component}


@pytest.fixture(scope="module")
def ha(tmp_path_factory) -> tuple[ClusterConfig, Path]:
    """configs/deploy-ha.yaml and the folder `pdd certs --server-configs` wrote for it."""
    return written(HA, tmp_path_factory.mktemp("ha"))


@pytest.mark.parametrize("dc", HA.sites)
def test_every_nats_server_routes_to_the_other_servers_services_and_ports_as_rendered(ha, dc):
    cfg, folder = ha
    site = HA.sites[dc]
    services, servers = of_kind(site, "Service"), of_component(site, "nats")
    assert len(servers) == cfg.control_plane.nats_servers == 3
    rendered = {name: ports_of(services[name])["route"] for name in servers}
    for name, d in servers.items():
        (container,) = pod(d)["containers"]
        conf = json.loads((folder / site_bundle(dc) / container["args"][-1].rsplit("/", 1)[1]).read_text())
        routes = {(u.hostname, u.port) for u in map(urlsplit, conf["cluster"]["routes"])}
        assert routes == {(other, port) for other, port in rendered.items() if other != name}, name
        assert conf["cluster"]["advertise"] == f"{name}:{rendered[name]}", "gossiped by its Service, not its pod's IP"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["route"] == int(conf["cluster"]["listen"].rsplit(":", 1)[1]), name
        route = [p for p in services[name]["spec"]["ports"] if p["name"] == "route"]
        assert route[0]["targetPort"] == ports["route"], name


def sans(pem: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(pem.read_bytes())
    return set(
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    )


@pytest.mark.parametrize("dc", HA.sites)
def test_the_sites_nats_certificate_names_every_service_its_servers_route_to(ha, dc):
    """A route checks the certificate of the server it dials against the name it dialed."""
    cfg, folder = ha
    assert set(of_component(HA.sites[dc], "nats")) <= sans(folder / site_bundle(dc) / "nats" / f"{dc}.pem")


def test_each_redis_replica_replicates_the_primarys_service(ha):
    cfg, folder = ha
    services = of_kind(HA.sites["A"], "Service")
    primary, port = urlsplit(cfg.redis_url).hostname, urlsplit(cfg.redis_url).port
    assert ports_of(services[primary]) == {"redis": port}
    login = json.loads((folder / site_bundle("A") / "credentials.json").read_text())["redis"]
    replicas = {n: d for n, d in of_component(HA.sites["A"], "redis").items() if n != primary}
    assert sorted(replicas) == ["redis-1"]
    for name, d in replicas.items():
        conf = redis_conf(folder / site_bundle("A") / f"{name}.conf")
        assert directive(conf, "replicaof") == [primary, str(port)]
        assert directive(conf, "masteruser") == [login["user"]] and directive(conf, "masterauth") == [login["password"]]
        assert [line[1] for line in conf if line[0] == "user"] == list(REDIS_USERS)  # the ACL users, no requirepass
        assert directive(conf, "replica-announce-ip") == [name]  # the Service the Sentinels hand to clients
        (container,) = pod(d)["containers"]
        assert (
            directive(conf, "port")
            == [str(container["ports"][0]["containerPort"])]
            == [str(ports_of(services[name])["redis"])]
        )
    conf = redis_conf(folder / site_bundle("A") / "redis.conf")  # a replica itself once it failed over and came back
    assert directive(conf, "masterauth") == [login["password"]] and directive(conf, "replica-announce-ip") == [primary]


def test_the_sentinels_monitor_the_primarys_service_with_a_majority_quorum(ha):
    cfg, folder = ha
    plane, services = cfg.control_plane, of_kind(HA.sites["A"], "Service")
    primary, port = urlsplit(cfg.redis_url).hostname, urlsplit(cfg.redis_url).port
    sentinels = of_component(HA.sites["A"], "sentinel")
    assert sorted(sentinels) == plane.sentinel_names and plane.sentinels == 3
    for name in sentinels:
        conf = redis_conf(folder / site_bundle("A") / f"{name}.conf")
        master = plane.redis_master
        monitor = directive(conf, "sentinel", "monitor", master)
        assert monitor == [primary, str(port), str(plane.sentinels // 2 + 1)] == [primary, "6379", "2"]
        assert conf.index(["sentinel", "resolve-hostnames", "yes"]) < conf.index(
            ["sentinel", "monitor", master, *monitor]
        )
        assert ["sentinel", "announce-hostnames", "yes"] in conf
        assert directive(conf, "sentinel", "announce-ip") == [name]  # what the other Sentinels record: its Service
        assert directive(conf, "port") == [str(ports_of(services[name])["sentinel"])]
        login = json.loads((folder / site_bundle("A") / "credentials.json").read_text())["redis"]
        assert directive(conf, "sentinel", "auth-user", master) == [login["user"]]
        assert directive(conf, "sentinel", "auth-pass", master) == [login["password"]]
        assert [line[1] for line in conf if line[0] == "user"] == list(REDIS_USERS)  # who may ask it
        assert directive(conf, "sentinel", "down-after-milliseconds", master) == [str(plane.sentinel_down_ms)]


def test_the_sentinel_config_is_copied_to_a_writable_volume():
    cfg = HA.cfg()
    for name, d in of_component(HA.sites["A"], "sentinel").items():
        spec = pod(d)
        (copying,) = spec["initContainers"]
        (container,) = spec["containers"]
        source, copy = copying["command"][-2:]
        assert source == f"{cfg.secrets_dir}/{name}.conf" and copying["command"][:3] == ["install", "-m", "600"]
        assert container["args"] == ["redis-server", copy, "--sentinel"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in (copying, container):
            (mount,) = [m for m in c["volumeMounts"] if copy.startswith(m["mountPath"] + "/")]
            assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), name
            (secrets,) = [m for m in c["volumeMounts"] if source.startswith(m["mountPath"] + "/")]
            assert "secret" in volumes[secrets["name"]] and secrets["readOnly"], name


def test_redis_sentinels_names_exactly_the_rendered_sentinel_services():
    cfg, services = HA.cfg(), of_kind(HA.sites["A"], "Service")
    rendered = {
        f"{n}:{ports_of(s)['sentinel']}" for n, s in services.items() if n in of_component(HA.sites["A"], "sentinel")
    }
    assert sorted(cfg.redis_sentinels.split(",")) == sorted(rendered) and len(rendered) == 3


def test_processes_wait_for_any_server_of_their_site_and_redis_through_its_sentinels():
    cfg = HA.cfg()
    for dc, site in HA.sites.items():
        nats = ",".join(f"{h}:{p}" for h, p in k8s.nats_services(cfg, dc).values())
        for name, d in pdd_deployments(site).items():
            (wait,) = pod(d)["initContainers"]
            assert wait["command"] == ["python", "-c", k8s.WAIT_FOR]
            assert wait["args"] == [nats, cfg.redis_sentinels] if dc == cfg.control_dc else [nats], name


def test_the_wait_ends_when_any_one_of_a_group_answers():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        answers = f"127.0.0.1:{listening.getsockname()[1]}"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
            silent = f"127.0.0.1:{closed.getsockname()[1]}"
            done = subprocess.run([sys.executable, "-c", k8s.WAIT_FOR, f"{silent},{answers}"], timeout=30)
    assert done.returncode == 0
