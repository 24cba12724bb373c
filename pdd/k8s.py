"""Kubernetes manifests, one Kustomize folder per site, from the same plan as the launcher.

`python -m pdd.k8s --config configs/deploy.yaml --out deploy/k8s` writes `site-<dc>/` for each
datacenter (`kubectl apply -k deploy/k8s/site-a`), one object per file, as
deploy/site-*.compose.yml run the site:
1. the cluster config as a ConfigMap, mounted where the image keeps it (`/app/configs/<name>`),
   so each pod's command is exactly the argv `plan_processes(cfg, that path)` gives;
2. the site's servers (pdd/k8s_servers.py): its NATS server or each of its NATS cluster, and
   Redis in the scheduler's site (the primary, each replica, each Sentinel);
3. a Deployment per planned process of the site, and a Service for what is reached: the
   gateway's port, each decoder's KV port, each NATS server's client, route and leafnode ports,
   each Redis server and Sentinel. What clients or the other site reach (the gateway; what
   `ClusterConfig.wan_forwards` says crosses the line) is a LoadBalancer; the rest stays inside
   the site.
The certificates and credentials are the Secret `pdd-secrets`, made from the bundles of the
site's processes and servers in `pdd certs`'s folder (`secret_command`): site A's Secret holds no
file of site B's. Each pod mounts only its own bundle of it, at `secrets_dir`, read-only
(pdd/k8s_objects.py has the pieces every object is made of).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path, PurePosixPath

import yaml

from pdd.k8s_objects import (
    API_KEYS,
    CA,
    CONFIG_MAP,
    CREDENTIALS,
    DNS_LABEL,
    IMAGE,
    IMAGE_CONFIGS,
    PDD_UID,
    REDIS_CONF,
    REQUESTS,
    SECRET,
    deployment,
    endpoint,
    kv_files,
    label,
    meta,
    nats_files,
    probes,
    secret_key,
    secrets_volume,
    security,
    server_conf_file,
    service,
)
from pdd.k8s_servers import nats_server, nats_services, redis_servers, sentinel_services
from pdd.topology import ProcessSpec, plan_processes
from shared.config import ClusterConfig, ConfigError, InstanceConfig, load_config
from shared.pipelines import ROLES, Role
from shared.security import bundle_name, site_bundle

WAIT_FOR = """import socket, sys, time
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


def process_files(cfg: ClusterConfig, spec: ProcessSpec) -> tuple[str, list[PurePosixPath]]:
    """(bundle, its files a process reads): an instance its certificate, key, the CA and its
    credentials; a control-plane process its credentials alone."""
    inst = _instance(cfg, spec)
    return bundle_name(str(spec.role), spec.name), [CA, CREDENTIALS, *kv_files(inst.id)] if inst else [CREDENTIALS]


def secret_files(cfg: ClusterConfig, dc: str) -> dict[str, PurePosixPath]:
    """Key -> path in `pdd certs --server-configs`'s folder, of every file site `dc` needs: its
    servers' site bundle, and the bundle of each of its processes."""
    plane = cfg.control_plane
    redis = [REDIS_CONF, *map(server_conf_file, [*plane.replica_names, *plane.sentinel_names])]
    site = PurePosixPath(site_bundle(dc))
    paths = [site / p for p in nats_files(cfg, dc)]  # its credentials are in the configs already
    paths += [site / p for p in redis] if dc == cfg.control_dc else []
    for spec in plan_processes(cfg, ""):
        if spec.dc == dc:
            bundle, files = process_files(cfg, spec)
            paths += [bundle / p for p in files]
    return {secret_key(p): p for p in dict.fromkeys(paths)}


def secret_command(cfg: ClusterConfig, dc: str, folder: str = "secrets") -> str:
    """The `kubectl` line that makes site `dc`'s Secret from `pdd certs --server-configs`'s output."""
    files = [f"--from-file={key}={folder}/{path}" for key, path in secret_files(cfg, dc).items()]
    return " \\\n    ".join([f"kubectl create secret generic {SECRET}", *files])


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
    return [service(label(name, "Service"), selector, {"kv": (ports["kv"], ports["kv"])}, exposed=crosses)]


def _waits_for(cfg: ClusterConfig, dc: str) -> list[str]:
    """The servers a process of site `dc` waits for (the compose files' depends_on), each
    argument `host:port,...` of which any one answering will do: a member of a cluster may be
    down when the pod starts. Redis is reached through its Sentinels when it has them."""
    groups = [list(nats_services(cfg, dc).values())]
    if dc == cfg.control_dc:
        groups.append(sentinel_services(cfg) or [endpoint(cfg.redis_url, "redis_url")])
    return [",".join(f"{host}:{port}" for host, port in group) for group in groups]


def _requests(role: str, inst: InstanceConfig | None) -> dict:
    if inst is None:
        return REQUESTS.get(role, REQUESTS["scheduler"])
    return {"cpu": str(inst.threads if isinstance(inst.threads, int) else 1)} | REQUESTS["engine"]


def process(cfg: ClusterConfig, spec: ProcessSpec, config_path: PurePosixPath, config_hash: str) -> list[dict]:
    """A planned process: its Deployment (command: the plan's argv) and what reaches it."""
    inst, role = _instance(cfg, spec), str(spec.role)
    ports = _process_ports(cfg, spec, inst)
    secrets, secrets_mount = secrets_volume(cfg, *process_files(cfg, spec))
    pod_security, container_security = security(PDD_UID)
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
        container |= probes({"tcpSocket": {"port": "http"}})
        container["envFrom"] = [{"secretRef": {"name": API_KEYS, "optional": True}}]  # PDD_API_KEYS, ...
    wait = {"name": "wait-for-servers", "image": IMAGE, "command": ["python", "-c", WAIT_FOR]}
    wait |= {"args": _waits_for(cfg, spec.dc), "securityContext": container_security}
    pod = {
        "shareProcessNamespace": True,  # the compose files' `init: true`: the pause process is PID 1
        "securityContext": pod_security,
        "initContainers": [wait],  # the compose files' depends_on: the site's servers answer first
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": CONFIG_MAP}}, secrets],
    }
    annotations = {"pdd/config-sha256": config_hash}  # a new config replaces the pods
    deployed = deployment(label(spec.name, "process"), role, pod, annotations)
    return [deployed, *_process_services(cfg, spec, inst, ports)]


def site_objects(cfg: ClusterConfig, config_name: str, config_text: str, dc: str) -> list[dict]:
    """Every object of site `dc`, in the order they start."""
    if not cfg.secrets_dir:
        raise ConfigError("secrets_dir must name where the pods mount the Secret (e.g. /etc/pdd/secrets)")
    config_path = IMAGE_CONFIGS / config_name
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(CONFIG_MAP, "config"),
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
