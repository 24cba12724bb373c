"""The two-site cluster on one host: which processes run in which site, on which ports.

`resolve()` turns a config into a runnable one for this host: every instance's `threads: auto`
becomes its share of this host's cores (`ClusterConfig.threads_of`), every port left at 0 gets a free
one (so a firewall-style test can name each), each site gets its NATS server's URL, the
decoders in the other site are reached through the emulated line's forward ports, that site's
NATS server joins the scheduler's through the line, and a throwaway CA and credentials are made
when the config names none. `plan_processes()` lists the service processes in start order;
docker-compose.yml and deploy/ mirror it (tests/test_compose.py keeps them equal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from pdd.servers import free_port
from shared.config import ClusterConfig, DatacenterConfig
from shared.pipelines import Role


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    role: str
    dc: str  # the site it runs in ("" for the WAN emulator: it is the line between them)
    argv: tuple[str, ...]


def plan_processes(cfg: ClusterConfig, config_path: str) -> list[ProcessSpec]:
    """Every service process of the cluster, in start order."""

    def spec(name: str, role: str, dc: str, *extra: str) -> ProcessSpec:
        return ProcessSpec(name, role, dc, ("pdd", "serve", role, "--config", config_path, *extra))

    def control(name: str, kind: str) -> ProcessSpec:  # one of several is named on its command line
        return spec(name, kind, cfg.control_dc, *(("--instance", name) if name != kind else ()))

    plane = cfg.control_plane
    specs = [spec("wanlink", "wanlink", "")] if cfg.wan.enabled else []
    specs += [control(name, "scheduler") for name in plane.scheduler_names]
    specs += [spec(i.id, i.role, i.dc, "--instance", i.id) for i in cfg.instances]
    specs += [control(name, "gateway") for name in plane.gateway_names]
    return specs


def control_plane_ports(cfg: ClusterConfig) -> dict[str, int]:
    """Ports of the control plane's extra members (control_plane.ports): the gateways and the
    schedulers' metrics after the first, each site's NATS servers after the first (and every
    server's route port when they are clustered), the Redis replicas and the Sentinels."""
    plane, given = cfg.control_plane, cfg.control_plane.ports
    names = [*plane.gateway_names[1:], *plane.scheduler_names[1:]]
    for dc in cfg.datacenters:
        for k in range(plane.nats_servers if plane.nats_servers > 1 else 0):
            server = f"nats-{dc.name}-{k}"
            names += [f"{server}-route"] + ([server] if k else [])
            names += [f"{server}-leaf"] if k and dc.name == cfg.control_dc else []
    names += plane.replica_names + plane.sentinel_names
    return {name: _port(given.get(name, 0)) for name in names}


def _port(p: int) -> int:
    return p or free_port()


def resolve(cfg: ClusterConfig, run_dir: Path) -> ClusterConfig:
    """A config for this host: free ports where 0, site URLs, forwards through the line, secrets."""
    instances = tuple(
        dataclasses.replace(
            i,
            kv_port=_port(i.kv_port) if i.role != Role.PREFILL else 0,
            metrics_port=_port(i.metrics_port),
            threads=cfg.threads_of(i),
            max_step_tokens=cfg.step_tokens_of(i),
        )
        for i in cfg.instances
    )
    sites = tuple(
        dataclasses.replace(
            dc, nats_port=_port(dc.nats_port), leaf_port=_port(dc.leaf_port) if dc.name == cfg.control_dc else 0
        )
        for dc in cfg.datacenters
    )
    scheduler = dataclasses.replace(cfg.scheduler, metrics_port=_port(cfg.scheduler.metrics_port))
    cfg = dataclasses.replace(
        cfg,
        instances=instances,
        datacenters=sites,
        port=_port(cfg.port),
        scheduler=scheduler,
        redis_port=_port(cfg.redis_port),
        nats_url="",
        control_plane=dataclasses.replace(cfg.control_plane, ports=control_plane_ports(cfg)),
    )
    ports = {name: _port(cfg.wan.ports.get(name, 0)) for name, *_ in cfg.wan_forwards()} if cfg.wan.enabled else {}
    capture = cfg.wan.capture_dir or str(run_dir / "wan-capture")  # written only when turned on
    cfg = dataclasses.replace(cfg, wan=dataclasses.replace(cfg.wan, ports=ports, capture_dir=capture))
    cfg = dataclasses.replace(cfg, datacenters=tuple(_site_urls(cfg, dc) for dc in cfg.datacenters))
    if not cfg.redis_url:
        cfg = dataclasses.replace(cfg, redis_url=f"redis://127.0.0.1:{cfg.redis_port}")
    if not cfg.redis_sentinels and cfg.control_plane.sentinels:
        ports = cfg.control_plane.ports
        where = ",".join(f"127.0.0.1:{ports[name]}" for name in cfg.control_plane.sentinel_names)
        cfg = dataclasses.replace(cfg, redis_sentinels=where)
    if not cfg.secrets_dir:
        from pdd.certs import make_secrets  # cryptography: only when a throwaway set is needed

        cfg = dataclasses.replace(cfg, secrets_dir=str(make_secrets(cfg, run_dir / "secrets")))
    return cfg


def _site_urls(cfg: ClusterConfig, dc: DatacenterConfig) -> DatacenterConfig:
    """Its services' NATS URLs (every server of the site: a client moves to another when its
    own dies); for a site other than the scheduler's, where its servers join the scheduler's
    site: through the line when it is emulated, else straight to the leaf ports (any of them)."""
    urls = ",".join(f"nats://127.0.0.1:{server.port}" for server in cfg.nats_servers(dc.name))
    dc = dataclasses.replace(dc, nats_url=dc.nats_url or urls)
    if dc.name != cfg.control_dc and not dc.leaf_remote:
        home = cfg.datacenter(cfg.control_dc)
        remotes = []
        for k, server in enumerate(cfg.nats_servers(cfg.control_dc)):
            through = cfg.wan.ports.get(f"nats-{dc.name}" + (f"-{k}" if k else ""))
            host = (cfg.wan.host or cfg.host) if through else (home.leaf_host or cfg.host)
            remotes.append(f"{host}:{through or server.leaf_port}")
        dc = dataclasses.replace(dc, leaf_remote=",".join(remotes))
    return dc
