"""The servers of a site on Kubernetes (pdd/k8s.py): its NATS server, or each server of its NATS
cluster, and in the scheduler's site Redis: the primary, each replica and each Sentinel its own
pod, each running the config `pdd certs --server-configs` wrote for it into the site's bundle (it
holds passwords, so it comes from the Secret; a server's pod mounts the site bundle's files it
reads, no process's). One function per kind."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from pdd.k8s_objects import (
    NATS_IMAGE,
    NATS_UID,
    REDIS_CONF,
    REDIS_IMAGE,
    REDIS_UID,
    REQUESTS,
    deployment,
    endpoint,
    label,
    nats_files,
    probes,
    server_conf_file,
    server_pod,
    service,
)
from pdd.natsconf import server_conf
from shared.config import ClusterConfig, ConfigError, NatsServer
from shared.security import site_bundle

SENTINEL_DIR = PurePosixPath("/sentinel")  # a Sentinel's own copy of its config, which it rewrites


def nats_services(cfg: ClusterConfig, dc: str) -> dict[str, tuple[str, int]]:
    """Each NATS server of site `dc`, by name: (its Service, the client port there). They are
    what the site's `nats_url` lists; a clustered site's servers also route to each other at
    the Services `control_plane.hosts` names, which must be the same."""
    what = f"datacenters.{dc}.nats_url"
    urls = dict(endpoint(url, what) for url in cfg.datacenter(dc).nats_url.split(","))
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
    return {name: (label(host, f"control_plane.hosts.{name}"), urls[host]) for name, host in hosts.items()}


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
        "args": [
            "nats-server",
            "-c",
            f"{cfg.secrets_dir}/{server_conf_file(server.name)}",
        ],  # args: the image's entrypoint runs
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": {"requests": REQUESTS["nats"]},
        **probes(check),
    }
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "nats"}
    in_site = {"client": (client, ports["client"])}
    in_site |= {"route": (server.route_port, ports["route"])} if "route" in ports else {}  # as the others dial it
    out = [
        deployment(name, "nats", server_pod(cfg, NATS_UID, container, site_bundle(dc), nats_files(cfg, dc, [server])))
    ]
    out.append(service(name, selector, in_site, exposed=False))
    if "leafnode" in ports:  # the other sites' servers join here, over the WAN
        leaf = ports["leafnode"]
        out.append(service(f"{name}-leaf", selector, {"leafnode": (leaf, leaf)}, exposed=True))
    return out


def redis_server(cfg: ClusterConfig) -> list[dict]:
    """Redis, in the scheduler's site only (no TLS: it never faces the WAN)."""
    name, port = endpoint(cfg.redis_url, "redis_url")
    ping = {"exec": {"command": ["sh", "-c", "redis-cli ping 2>&1 | grep -qE 'PONG|NOAUTH'"]}}
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["redis-server", f"{cfg.secrets_dir}/{REDIS_CONF}"],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "resources": {"requests": REQUESTS["redis"]},
        **probes(ping),
    }
    pod = server_pod(cfg, REDIS_UID, container, site_bundle(cfg.control_dc), [REDIS_CONF])
    selector = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "redis"}
    return [deployment(name, "redis", pod), service(name, selector, {"redis": (port, 6379)}, exposed=False)]


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
        **probes(ping),
    }
    pod = server_pod(cfg, REDIS_UID, container, site_bundle(cfg.control_dc), [server_conf_file(name)])
    selector = {"app.kubernetes.io/name": label(name, component), "app.kubernetes.io/component": component}
    return pod, service(name, selector, {component: (port, port)}, exposed=False)


def redis_replica(cfg: ClusterConfig, name: str) -> list[dict]:
    """A replica of the primary (its config says `replicaof` the primary's Service)."""
    pod, reached = _redis_member(cfg, name, "redis", ["redis-server", f"{cfg.secrets_dir}/{server_conf_file(name)}"])
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
    command = [
        "install",
        "-m",
        "600",
        f"{cfg.secrets_dir}/{server_conf_file(name)}",
        str(copy),
    ]  # it refuses one it cannot write
    copying = {"name": "copy-config", "image": REDIS_IMAGE, "command": command}
    copying |= {"volumeMounts": list(container["volumeMounts"]), "securityContext": container["securityContext"]}
    pod = {"securityContext": pod["securityContext"], "initContainers": [copying], **pod}
    pod["volumes"].append({"name": "sentinel", "emptyDir": {}})
    return [deployment(name, "sentinel", pod), reached]


def sentinel_services(cfg: ClusterConfig) -> list[tuple[str, int]]:
    """(Service, port) of each Sentinel. The gateways and schedulers ask them for the primary at
    `redis_sentinels`, which must name exactly these."""
    rendered = [(label(name, "Sentinel"), _member_port(cfg, name)) for name in cfg.control_plane.sentinel_names]
    expected = [f"{host}:{port}" for host, port in rendered]
    if sorted(filter(None, cfg.redis_sentinels.split(","))) != sorted(expected):
        given = cfg.redis_sentinels
        raise ConfigError(f"redis_sentinels {given!r} must name the Sentinels' Services: {','.join(expected)!r}")
    return rendered


def redis_servers(cfg: ClusterConfig) -> list[dict]:
    """The primary, its replicas, the Sentinels: each its own pod (in the scheduler's site only)."""
    objects = redis_server(cfg)
    for name in cfg.control_plane.replica_names:
        objects += redis_replica(cfg, name)
    for name in cfg.control_plane.sentinel_names:
        objects += sentinel(cfg, name)
    return objects
