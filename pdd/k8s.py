"""Kubernetes manifests, one Kustomize folder per site, from the same plan as the launcher.

`python -m pdd.k8s --config configs/deploy.yaml --out deploy/k8s` writes `site-<dc>/` for each
datacenter (`kubectl apply -k deploy/k8s/site-a`), one object per file, as
deploy/site-*.compose.yml run the site:
1. the cluster config as a ConfigMap, mounted where the image keeps it (`/app/configs/<name>`),
   so each pod's command is exactly the argv `plan_processes(cfg, that path)` gives;
2. the site's servers: its NATS server, or each server of its NATS cluster, with the config
   `pdd certs --server-configs` wrote for it (`natsconf.server_conf`: it holds passwords, so it
   comes from the Secret), and Redis in the scheduler's site: the primary, each replica and
   each Sentinel its own pod, running the config `certs.redis_configs` wrote for it; one
   function per kind (`nats_server`, `redis_server`, `redis_replica`, `sentinel`);
3. a Deployment per planned process of the site, and a Service for what is reached: the
   gateway's port, each decoder's KV port, each NATS server's client, route and leafnode ports,
   each Redis server and Sentinel. What clients or the other site reach (the gateway; what
   `ClusterConfig.wan_forwards` says crosses the line) is a LoadBalancer; the rest stays inside
   the site.
The certificates and credentials are the Secret `pdd-secrets`, made from `pdd certs`'s folder
(`secret_command`); each pod mounts only its own files of it, at `secrets_dir`, read-only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import yaml

from pdd.natsconf import server_conf
from pdd.topology import ProcessSpec, plan_processes
from shared.config import ClusterConfig, ConfigError, InstanceConfig, NatsServer, load_config
from shared.pipelines import ROLES, Role
from shared.security import Secrets

IMAGE = "pdd:local"  # the compose files' tag; Kubernetes would pull a `:latest` on every start
NATS_IMAGE, REDIS_IMAGE = "nats:2.10-alpine", "redis:7"
IMAGE_CONFIGS = PurePosixPath("/app/configs")  # the Dockerfile's WORKDIR /app
CONFIG_MAP, SECRET, API_KEYS = "pdd-config", "pdd-secrets", "pdd-api-keys"
PDD_UID, REDIS_UID, NATS_UID = 10001, 999, 65534  # the image's `pdd` user, redis:7's, nobody
CREDENTIALS, REDIS_CONF = PurePosixPath("credentials.json"), PurePosixPath("redis.conf")  # as pdd/certs.py names them
CA = PurePosixPath(Secrets(Path()).ca)
SENTINEL_DIR = PurePosixPath("/sentinel")  # a Sentinel's own copy of its config, which it rewrites
REQUESTS = {  # a starting point: an engine needs its model plus `kv_tokens` of KV in memory
    "engine": {"memory": "4Gi"},
    "gateway": {"cpu": "500m", "memory": "1Gi"},
    "scheduler": {"cpu": "500m", "memory": "512Mi"},
    "nats": {"cpu": "100m", "memory": "128Mi"},
    "redis": {"cpu": "100m", "memory": "256Mi"},
    "sentinel": {"cpu": "50m", "memory": "64Mi"},
}
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
WAIT_FOR = """import socket, sys, time
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    while True:
        try:
            socket.create_connection((host, int(port)), 2).close()
            break
        except OSError:
            print("waiting for", target, flush=True)
            time.sleep(2)
"""
WAIT_FOR_ANY = """import socket, sys, time
def answers(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), 2).close()
        return True
    except OSError:
        return False
for targets in sys.argv[1:]:
    while not any(answers(target) for target in targets.split(",")):
        print("waiting for one of", targets, flush=True)
        time.sleep(2)
"""


def site_folder(dc: str) -> str:
    return f"site-{dc.lower()}"


def _label(name: str, what: str) -> str:
    if not DNS_LABEL.fullmatch(name):
        raise ConfigError(f"{what} {name!r} is not a Kubernetes name (lowercase letters, digits, '-')")
    return name


def _endpoint(url: str, what: str) -> tuple[str, int]:
    """(Service name, port) of a `scheme://name:port` URL: in-site servers are reached by Service."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ConfigError(f"{what} {url!r} must be scheme://service-name:port")
    return _label(parts.hostname, what), parts.port


def _meta(name: str, component: str) -> dict:
    return {"name": name, "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/component": component}}


def deployment(name: str, component: str, pod: dict, annotations: dict | None = None) -> dict:
    """One pod, replaced rather than rolled: two pods of one instance id must never run at once."""
    template = {"labels": _meta(name, component)["labels"]} | ({"annotations": annotations} if annotations else {})
    pod = {"enableServiceLinks": False, **pod}  # no FOO_PORT=tcp://... variables beside PDD_PORT
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, component),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": template, "spec": pod},
        },
    }


def service(name: str, selector: dict, ports: dict[str, tuple[int, int | str]], exposed: bool) -> dict:
    """`ports`: name -> (port, container port). `exposed`: reached from outside the site."""
    spec = {"type": "LoadBalancer" if exposed else "ClusterIP", "selector": selector}
    spec["ports"] = [{"name": n, "port": p, "targetPort": t, "protocol": "TCP"} for n, (p, t) in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, selector["app.kubernetes.io/component"]),
        "spec": spec,
    }


def _key(path: PurePosixPath) -> str:
    """A file's key in the Secret: keys hold no '/', so kv/md-0.pem is kv-md-0.pem."""
    return str(path).replace("/", "-")


def _conf(server: str) -> PurePosixPath:
    """The config `pdd certs --server-configs` writes for the server of that name."""
    return PurePosixPath(f"{server}.conf")


def secret_files(cfg: ClusterConfig, dc: str) -> dict[str, PurePosixPath]:
    """Key -> path in `pdd certs --server-configs`'s folder, of every file site `dc` needs."""
    redis = [REDIS_CONF, *map(_conf, [*_replicas(cfg), *cfg.control_plane.sentinel_names])]
    paths = [CA, CREDENTIALS, *_nats_files(cfg, dc), *(redis if dc == cfg.control_dc else [])]
    paths += [p for i in cfg.instances if i.dc == dc for p in _kv_files(i.id)]
    return {_key(p): p for p in dict.fromkeys(paths)}


def _kv_files(instance: str) -> list[PurePosixPath]:
    return [PurePosixPath(p) for p in Secrets(Path()).cert("kv", instance)]


def _nats_files(cfg: ClusterConfig, dc: str, servers: list[NatsServer] | None = None) -> list[PurePosixPath]:
    """The configs of `servers` (default: every one of the site's), the CA, the site's certificate."""
    confs = [_conf(s.name) for s in servers or cfg.nats_servers(dc)]
    return [*confs, CA, *map(PurePosixPath, Secrets(Path()).cert("nats", dc))]


def secret_command(cfg: ClusterConfig, dc: str, folder: str = "secrets") -> str:
    """The `kubectl` line that makes site `dc`'s Secret from `pdd certs --server-configs`'s output."""
    files = [f"--from-file={key}={folder}/{path}" for key, path in secret_files(cfg, dc).items()]
    return " \\\n    ".join([f"kubectl create secret generic {SECRET}", *files])


def _secrets_volume(cfg: ClusterConfig, paths: list[PurePosixPath]) -> tuple[dict, dict]:
    """(volume, mount) of these files of the Secret only, group-readable by the pod's fsGroup."""
    items = [{"key": _key(p), "path": str(p)} for p in paths]
    volume = {"name": "secrets", "secret": {"secretName": SECRET, "defaultMode": 0o440, "items": items}}
    return volume, {"name": "secrets", "mountPath": cfg.secrets_dir, "readOnly": True}


def _security(uid: int) -> tuple[dict, dict]:
    """(pod, container) security contexts: a fixed non-root user, as the compose files' images."""
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}
    pod["seccompProfile"] = {"type": "RuntimeDefault"}
    return pod, {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _probes(handler: dict) -> dict:
    """The compose healthchecks' test, every 2 s, as readiness; liveness the same, less eager."""
    return {
        "readinessProbe": {**handler, "periodSeconds": 2, "timeoutSeconds": 2, "failureThreshold": 3},
        "livenessProbe": {**handler, "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3},
    }


def _server_pod(cfg: ClusterConfig, uid: int, container: dict, files: list[PurePosixPath]) -> dict:
    volume, mount = _secrets_volume(cfg, files)
    pod_security, container_security = _security(uid)
    container |= {"volumeMounts": [mount], "securityContext": container_security}
    return {"securityContext": pod_security, "containers": [container], "volumes": [volume]}


def nats_services(cfg: ClusterConfig, dc: str) -> dict[str, tuple[str, int]]:
    """Each NATS server of site `dc`, by name: (its Service, the client port there). They are
    what the site's `nats_url` lists; a clustered site's servers also route to each other at
    the Services `control_plane.hosts` names, which must be the same."""
    what = f"datacenters.{dc}.nats_url"
    urls = dict(_endpoint(url, what) for url in cfg.datacenter(dc).nats_url.split(","))
    servers = cfg.nats_servers(dc)
    if len(servers) == 1 and len(urls) == 1:
        return {servers[0].name: next(iter(urls.items()))}
    hosts = {s.name: cfg.control_plane.hosts.get(s.name, "") for s in servers}
    if sorted(hosts.values()) != sorted(urls):
        named = ", ".join(f"{name}: {host or '(none)'}" for name, host in hosts.items())
        raise ConfigError(
            f"{what} must list each NATS server of site {dc} at its Service, as control_plane.hosts "
            f"names them for the routes ({named})"
        )
    return {name: (_label(host, f"control_plane.hosts.{name}"), urls[host]) for name, host in hosts.items()}


def _listen_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def nats_server(cfg: ClusterConfig, dc: str, server: NatsServer) -> list[dict]:
    """NATS server `server` of site `dc`; its ports are those `server_conf` makes it listen on."""
    name, client = nats_services(cfg, dc)[server.name]
    conf = json.loads(server_conf(cfg, cfg.datacenter(dc), None, server=server))
    ports = {"client": _listen_port(conf["listen"])}
    if "cluster" in conf:
        ports["route"] = _listen_port(conf["cluster"]["listen"])
    if "listen" in conf.get("leafnodes", {}):
        ports["leafnode"] = _listen_port(conf["leafnodes"]["listen"])
    if conf.get("http_port"):
        ports["monitor"] = conf["http_port"]
    check = (
        {"httpGet": {"path": "/healthz", "port": "monitor"}}
        if "monitor" in ports
        else {"tcpSocket": {"port": "client"}}
    )
    container = {
        "name": "nats",
        "image": NATS_IMAGE,
        "args": ["nats-server", "-c", f"{cfg.secrets_dir}/{_conf(server.name)}"],  # args: the image's entrypoint runs
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": {"requests": REQUESTS["nats"]},
        **_probes(check),
    }
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "nats"}
    in_site = {"client": (client, ports["client"])}
    in_site |= {"route": (server.route_port, ports["route"])} if "route" in ports else {}  # as the others dial it
    out = [deployment(name, "nats", _server_pod(cfg, NATS_UID, container, _nats_files(cfg, dc, [server])))]
    out.append(service(name, selector, in_site, exposed=False))
    if "leafnode" in ports:  # the other sites' servers join here, over the WAN
        leaf = ports["leafnode"]
        out.append(service(f"{name}-leaf", selector, {"leafnode": (leaf, leaf)}, exposed=True))
    return out


def redis_server(cfg: ClusterConfig) -> list[dict]:
    """Redis, in the scheduler's site only (no TLS: it never faces the WAN)."""
    name, port = _endpoint(cfg.redis_url, "redis_url")
    ping = {"exec": {"command": ["sh", "-c", "redis-cli ping 2>&1 | grep -qE 'PONG|NOAUTH'"]}}
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["redis-server", f"{cfg.secrets_dir}/{REDIS_CONF}"],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "resources": {"requests": REQUESTS["redis"]},
        **_probes(ping),
    }
    pod = _server_pod(cfg, REDIS_UID, container, [REDIS_CONF])
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "redis"}
    return [deployment(name, "redis", pod), service(name, selector, {"redis": (port, 6379)}, exposed=False)]


def _replicas(cfg: ClusterConfig) -> list[str]:
    return [f"redis-{k}" for k in range(1, cfg.control_plane.redis_replicas + 1)]


def _member_port(cfg: ClusterConfig, name: str) -> int:
    """A replica's or Sentinel's port: fixed in control_plane.ports, since its Service names it."""
    port = cfg.control_plane.ports.get(name, 0)
    if not port:
        raise ConfigError(f"control_plane.ports must fix {name}'s port (not 0) for Kubernetes")
    return port


def _redis_member(cfg: ClusterConfig, name: str, component: str, args: list[str]) -> tuple[dict, dict]:
    """(pod, Service) of a replica or a Sentinel: reached at its own name, the one its config
    announces (`certs.redis_configs`), on the port it listens on."""
    port = _member_port(cfg, name)
    ping = {"exec": {"command": ["sh", "-c", f"redis-cli -p {port} ping 2>&1 | grep -qE 'PONG|NOAUTH'"]}}
    container = {
        "name": component,
        "image": REDIS_IMAGE,
        "args": args,
        "ports": [{"name": component, "containerPort": port}],
        "resources": {"requests": REQUESTS[component]},
        **_probes(ping),
    }
    pod = _server_pod(cfg, REDIS_UID, container, [_conf(name)])
    selector = {"app.kubernetes.io/name": _label(name, component), "app.kubernetes.io/component": component}
    return pod, service(name, selector, {component: (port, port)}, exposed=False)


def redis_replica(cfg: ClusterConfig, name: str) -> list[dict]:
    """A replica of the primary (its config says `replicaof` the primary's Service)."""
    pod, reached = _redis_member(cfg, name, "redis", ["redis-server", f"{cfg.secrets_dir}/{_conf(name)}"])
    return [deployment(name, "redis", pod), reached]


def sentinel(cfg: ClusterConfig, name: str) -> list[dict]:
    """A Sentinel of the primary. It rewrites its config as the primary moves, and the Secret is
    read-only: a first container copies the config into a volume of the pod's own, where the
    Sentinel's record of the failovers outlives a restart of its container."""
    copy = SENTINEL_DIR / "sentinel.conf"
    pod, reached = _redis_member(cfg, name, "sentinel", ["redis-server", str(copy), "--sentinel"])
    (container,) = pod["containers"]
    writable = {"name": "sentinel", "mountPath": str(SENTINEL_DIR)}
    container["volumeMounts"].append(writable)
    command = ["install", "-m", "600", f"{cfg.secrets_dir}/{_conf(name)}", str(copy)]  # it refuses one it cannot write
    copying = {"name": "copy-config", "image": REDIS_IMAGE, "command": command}
    copying |= {"volumeMounts": list(container["volumeMounts"]), "securityContext": container["securityContext"]}
    pod = {"securityContext": pod["securityContext"], "initContainers": [copying], **pod}
    pod["volumes"].append({"name": "sentinel", "emptyDir": {}})
    return [deployment(name, "sentinel", pod), reached]


def sentinel_services(cfg: ClusterConfig) -> list[tuple[str, int]]:
    """(Service, port) of each Sentinel. The gateways and schedulers ask them for the primary at
    `redis_sentinels`, which must name exactly these."""
    rendered = [(_label(name, "Sentinel"), _member_port(cfg, name)) for name in cfg.control_plane.sentinel_names]
    expected = [f"{host}:{port}" for host, port in rendered]
    if sorted(filter(None, cfg.redis_sentinels.split(","))) != sorted(expected):
        given = cfg.redis_sentinels
        raise ConfigError(f"redis_sentinels {given!r} must name the Sentinels' Services: {','.join(expected)!r}")
    return rendered


def redis_servers(cfg: ClusterConfig) -> list[dict]:
    """The primary, its replicas, the Sentinels: each its own pod (in the scheduler's site only)."""
    objects = redis_server(cfg)
    for name in _replicas(cfg):
        objects += redis_replica(cfg, name)
    for name in cfg.control_plane.sentinel_names:
        objects += sentinel(cfg, name)
    return objects


def _instance(cfg: ClusterConfig, spec: ProcessSpec) -> InstanceConfig | None:
    """The model instance a process serves (a gateway or scheduler may carry --instance too)."""
    return {i.id: i for i in cfg.instances}.get(spec.name) if str(spec.role) in ROLES else None


def _process_ports(cfg: ClusterConfig, spec: ProcessSpec, inst: InstanceConfig | None) -> dict[str, int]:
    """What the process listens on: fixed in the config, since a Service names each port."""
    ports = {}
    if spec.role == "gateway":
        try:
            ports["http"] = cfg.gateway_port(spec.name)
        except KeyError:
            ports["http"] = 0
    if inst is not None and inst.role != Role.PREFILL:
        ports["kv"] = inst.kv_port
    unset = [name for name, port in ports.items() if not port]
    if unset:
        raise ConfigError(f"{spec.name}: its {unset[0]} port must be fixed in the config (not 0) for Kubernetes")
    metrics = inst.metrics_port if inst else cfg.scheduler_metrics_port(spec.name) if spec.role == "scheduler" else 0
    return ports | ({"metrics": metrics} if metrics else {})


def _process_services(cfg: ClusterConfig, spec: ProcessSpec, inst: InstanceConfig | None, ports: dict) -> list:
    """The gateway's Service selects every gateway process; a decoder's is named as prefill dials it."""
    selector = {"app.kubernetes.io/component": str(spec.role)}
    if "http" in ports:
        return [service("gateway", selector, {"http": (cfg.port, "http")}, exposed=True)]  # each pod's own port
    if "kv" not in ports:
        return []
    name = inst.host if DNS_LABEL.fullmatch(inst.host) else inst.id  # else reached by an outside name
    crosses = inst.id in {forward for forward, *_ in cfg.wan_forwards()}
    selector = {"app.kubernetes.io/name": spec.name} | selector
    return [service(_label(name, "Service"), selector, {"kv": (ports["kv"], ports["kv"])}, exposed=crosses)]


def _waits_for(cfg: ClusterConfig, dc: str) -> list[str]:
    """The servers a process of site `dc` waits for (the compose files' depends_on), each
    argument `host:port,...` of which any one answering will do: a member of a cluster may be
    down when the pod starts. Redis is reached through its Sentinels when it has them."""
    groups = [list(nats_services(cfg, dc).values())]
    if dc == cfg.control_dc:
        groups.append(sentinel_services(cfg) or [_endpoint(cfg.redis_url, "redis_url")])
    return [",".join(f"{host}:{port}" for host, port in group) for group in groups]


def _requests(role: str, inst: InstanceConfig | None) -> dict:
    if inst is None:
        return REQUESTS.get(role, REQUESTS["scheduler"])
    return {"cpu": str(inst.threads if isinstance(inst.threads, int) else 1)} | REQUESTS["engine"]


def process(cfg: ClusterConfig, spec: ProcessSpec, config_path: PurePosixPath, config_hash: str) -> list[dict]:
    """A planned process: its Deployment (command: the plan's argv) and what reaches it."""
    inst, role = _instance(cfg, spec), str(spec.role)
    ports = _process_ports(cfg, spec, inst)
    secrets, secrets_mount = _secrets_volume(cfg, [CA, CREDENTIALS, *(_kv_files(inst.id) if inst else [])])
    pod_security, container_security = _security(PDD_UID)
    container = {
        "name": role,
        "image": IMAGE,
        "command": [str(a) for a in spec.argv],
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": {"requests": _requests(role, inst)},
        "volumeMounts": [
            {"name": "config", "mountPath": str(config_path), "subPath": config_path.name, "readOnly": True},
            secrets_mount,
        ],
        "securityContext": container_security,
    }
    if role == "gateway":  # /health is 503 while any role is missing (site B behind a cut line): not a probe
        container |= _probes({"tcpSocket": {"port": "http"}})
        container["envFrom"] = [{"secretRef": {"name": API_KEYS, "optional": True}}]  # PDD_API_KEYS, ...
    waits = _waits_for(cfg, spec.dc)
    script = WAIT_FOR_ANY if any("," in targets for targets in waits) else WAIT_FOR
    wait = {"name": "wait-for-servers", "image": IMAGE, "command": ["python", "-c", script]}
    wait |= {"args": waits, "securityContext": container_security}
    pod = {
        "shareProcessNamespace": True,  # the compose files' `init: true`: the pause process is PID 1
        "securityContext": pod_security,
        "initContainers": [wait],  # the compose files' depends_on: the site's servers answer first
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": CONFIG_MAP}}, secrets],
    }
    annotations = {"pdd/config-sha256": config_hash}  # a new config replaces the pods
    deployed = deployment(_label(spec.name, "process"), role, pod, annotations)
    return [deployed, *_process_services(cfg, spec, inst, ports)]


def site_objects(cfg: ClusterConfig, config_name: str, config_text: str, dc: str) -> list[dict]:
    """Every object of site `dc`, in the order they start."""
    if not cfg.secrets_dir:
        raise ConfigError("secrets_dir must name where the pods mount the Secret (e.g. /etc/pdd/secrets)")
    config_path = IMAGE_CONFIGS / config_name
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(CONFIG_MAP, "config"),
        "data": {config_name: config_text},
    }
    objects = [config_map]
    for server in cfg.nats_servers(dc):
        objects += nats_server(cfg, dc, server)
    objects += redis_servers(cfg) if dc == cfg.control_dc else []
    config_hash = hashlib.sha256(config_text.encode()).hexdigest()
    for spec in plan_processes(cfg, str(config_path)):
        if spec.dc == dc:
            objects += process(cfg, spec, config_path, config_hash)
    return list({(o["kind"], o["metadata"]["name"]): o for o in objects}.values())  # one gateway Service


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config, the wait script) as readable `|` blocks; no YAML aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def render(cfg: ClusterConfig, config_name: str, config_text: str) -> dict[str, str]:
    """Relative path -> text of every file, each site's kustomization.yaml included."""
    header = f"# Rendered by pdd/k8s.py from {config_name}: edit the config and re-render, not this file.\n"
    files = {}
    for dc in (d.name for d in cfg.datacenters):
        names = []
        for obj in site_objects(cfg, config_name, config_text, dc):
            names.append(f"{obj['metadata']['name']}.{obj['kind'].lower()}.yaml")
            files[f"{site_folder(dc)}/{names[-1]}"] = header + yaml.dump(obj, Dumper=_Dumper, sort_keys=False)
        how = "".join(f"#   {line}\n" for line in secret_command(cfg, dc).splitlines())
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": names}
        files[f"{site_folder(dc)}/kustomization.yaml"] = (
            f"{header}# Site {dc}. First its Secret, from the folder `pdd certs --server-configs` wrote:\n{how}"
            + yaml.dump(kustomization, Dumper=_Dumper, sort_keys=False)
        )
    return files


def load_file_config(path: Path) -> ClusterConfig:
    """The file alone: the PDD_ overrides of the shell that renders are not the pods'."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PDD_")}
    try:
        return load_config(path)
    finally:
        os.environ.update(saved)


def write(files: dict[str, str], out: Path) -> None:
    """Write `files` under `out`; a site folder's other .yaml files (objects no longer planned) go."""
    for folder in {Path(p).parent for p in files}:
        for old in (out / folder).glob("*.yaml"):
            if f"{folder}/{old.name}" not in files:
                old.unlink()
    for rel, text in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdd k8s", description="Kubernetes manifests, one Kustomize folder per site")
    parser.add_argument("--config", required=True, help="the cluster YAML (e.g. configs/deploy.yaml)")
    parser.add_argument("--out", default="deploy/k8s", help="writes OUT/site-<dc>/ for each datacenter")
    args = parser.parse_args(argv)
    path = Path(args.config)
    try:
        files = render(load_file_config(path), path.name, path.read_text())
    except (ConfigError, OSError) as e:
        print(f"pdd k8s: {e}", file=sys.stderr)
        return 2
    write(files, Path(args.out))
    for folder in sorted({Path(p).parent for p in files}):
        print(f"pdd k8s: wrote {Path(args.out) / folder} (kubectl apply -k {Path(args.out) / folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
