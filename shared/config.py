"""Cluster configuration: frozen dataclasses from one YAML file plus `PDD_` environment overrides.

One file describes the whole two-site cluster; each process reads it and takes its own part
(its instance, its datacenter's NATS server). Overrides for the process reading it:
PDD_NATS_URL (its own datacenter's NATS server), PDD_REDIS_URL (the scheduler's Redis),
PDD_REDIS_SENTINELS (its Sentinels, when it is replicated),
PDD_SECRETS_DIR (certificates and credentials, see pdd/certs.py), PDD_PORT (gateway port),
PDD_MODEL (model folder, or "default"). Validation errors name the bad value and where it came
from.

Addresses: every process binds `host` (0.0.0.0 in containers); others reach an instance's KV
listener at its own `host` (default: the cluster's), a site's leafnode port at its `leaf_host`,
and the emulated line at `wan.host`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from shared.model_info import WireFormat, parse_wire
from shared.pipelines import ROLES, Pipeline, Role
from shared.policy_knobs import PolicyKnobs

AUTO = "auto"  # InstanceConfig.threads (its share of its host's cores) and max_step_tokens (its role's)
DEFAULT_CONFIG = Path(importlib.util.find_spec("configs").submodule_search_locations[0]) / "single-host.yaml"
INSTANCE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ConfigError(ValueError):
    pass


def check_device(device: str, what: str) -> None:
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ConfigError(f"{what}: device {device!r} must be cpu, cuda or cuda:N")


@dataclass(frozen=True)
class InstanceConfig:
    id: str
    role: Role  # a plain string in the file: made a Role here, a plain string again in `to_dict`
    dc: str = "A"
    dtype: str = "float32"
    threads: int | str = 1  # torch threads, or "auto": this host's share (thread_budget below)
    kv_tokens: int = 16384
    max_step_tokens: int | str = AUTO  # tokens per engine step, or "auto": the role's (`step_tokens_of`)
    max_running: int = 32
    max_waiting: int = 64  # requests held beyond max_running (queued, or KV on its way); past it, refused
    prefix_cache: bool = True  # radix cache of earlier requests' KV (the DRC on decoders)
    batch_invariant: bool = (
        True  # CPU: one answer whatever the batch or route (docs/runtime.md); false: fastest kernels
    )
    host: str = ""  # where others reach this instance ("" = the cluster's host)
    kv_port: int = 0  # decoders: the KV listener (0 = any free port; name one so a firewall can)
    metrics_port: int = 0  # Prometheus /metrics (0 = none)
    device: str = "cpu"  # cpu | cuda | cuda:N (the model, its KV pool and CUDA-graph decode steps)

    def __post_init__(self) -> None:
        if not INSTANCE_ID.fullmatch(self.id):  # a NATS subject token, a user name, a file name
            raise ConfigError(f"instance {self.id!r}: an id is letters, digits, '-' and '_' (at most 64)")
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ConfigError(f"instance {self.id!r}: role {self.role!r} is not one of {ROLES}") from None
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"instance {self.id!r}: dtype {self.dtype!r} must be float32 or bfloat16")
        if self.threads != AUTO and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ConfigError(
                f"instance {self.id!r}: threads must be an integer >= 1 or {AUTO!r}, got {self.threads!r}"
            )
        if self.kv_tokens < 16:
            raise ConfigError(f"instance {self.id!r}: kv_tokens >= 16 required")
        step = self.max_step_tokens
        if step != AUTO and not (isinstance(step, int) and step >= 1):
            raise ConfigError(
                f"instance {self.id!r}: max_step_tokens must be an integer >= 1 or {AUTO!r}, got {step!r}"
            )
        if self.max_running < 1 or self.max_waiting < 0:
            raise ConfigError(f"instance {self.id!r}: max_running >= 1 and max_waiting >= 0 required")
        check_device(self.device, f"instance {self.id!r}")


@dataclass(frozen=True)
class DatacenterConfig:
    """One site: its NATS server, and how it joins the scheduler's site (a NATS leafnode link)."""

    name: str
    nats_url: str = ""  # its services' NATS server ("" = embedded, started by the launcher)
    nats_port: int = 0  # the embedded server's client port (0 = a free one)
    leaf_port: int = 0  # the scheduler's site: where other sites' NATS servers connect (TLS)
    leaf_host: str = ""  # the scheduler's site: where that port is reached ("" = the cluster's host)
    leaf_remote: str = ""  # the other sites: "host:port" they dial to join (the leaf port, or the line)
    monitor_port: int = 0  # the NATS server's HTTP monitoring port (/healthz), 0 = none


@dataclass(frozen=True)
class WanConfig:
    """The emulated line between datacenter A and B (absent in a real deployment). Every
    connection between the sites crosses it: the KV pushes to B's decoders and the NATS link.
    The settings are each direction's; `reverse` overrides some for B -> A."""

    name: str = "a-b"
    src_dc: str = "A"
    dst_dc: str = "B"
    bandwidth_mbps: float = 1000.0
    delay_ms: float = 10.0
    jitter_ms: float = 0.0
    swing: str = "none"  # none | schedule | random_walk
    schedule: tuple[tuple[float, float], ...] = ()  # (seconds since start, mbps), repeating
    walk_step: float = 0.2  # random walk: relative change per second
    walk_min_mbps: float = 50.0
    walk_max_mbps: float = 2000.0
    seed: int = 0
    enabled: bool = True
    reverse: dict[str, Any] = field(default_factory=dict)  # B -> A settings that differ
    ports: dict[str, int] = field(default_factory=dict)  # forward name -> emulator listen port
    host: str = ""  # where the emulator is reached ("" = the cluster's host)
    capture_dir: str = ""  # where `WanControl(capture=True)` records what crosses, like tcpdump on the line
    write_stall_s: float = 120.0  # a connection whose receiver takes nothing for this long is reset


FIRST_TOKEN_FROM = (Role.PREFILL.value, "decoder")  # ClusterConfig.first_token


@dataclass(frozen=True)
class Timeouts:
    control_s: float = 5.0  # every NATS request-reply
    kv_stall_s: float = 30.0  # a KV transfer with no progress for this long fails
    request_s: float = 600.0  # gateway gives up on a request with no token for this long
    client_s: float = 30.0  # a client's request body, and each SSE write to it, may take this long
    kv_retries: int = 2  # a failed KV push is retried this many times (the payload is kept)


@dataclass(frozen=True)
class HandoffConfig:
    """Relay -> main handoff. Catch-up sends `chunk_tokens` at a time while relay keeps
    streaming, and stops relay once the gap is at most `final_tokens`."""

    chunk_tokens: int = 64
    final_tokens: int = 8
    ack_timeout_s: float = 30.0  # a chunk's extend on a busy CPU can take seconds
    # a request that finishes on the relay before its handoff still sends its prompt KV to
    # main-decode's cache (the next turn of a session hits it there); false: the push is cancelled
    warm_md_cache: bool = True

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.final_tokens < 0:
            raise ConfigError(f"handoff: chunk_tokens >= 1 and final_tokens >= 0, got {self}")


@dataclass(frozen=True)
class SchedulerConfig(PolicyKnobs):
    """The `scheduler:` section: the policy's knobs (shared/policy_knobs.py says each, its default
    and its check; services/scheduler/policy.py documents each rule) plus the scheduler process's
    own settings below."""

    metrics_port: int = 0  # the scheduler's Prometheus /metrics (0 = none)
    kv_wire_in_dc: str = WireFormat.NATIVE.value  # KV to relays in the same datacenter (no auto)

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:
            raise ConfigError(f"scheduler.{e}") from None
        try:
            parse_wire(self.kv_wire_in_dc)
        except ValueError as e:
            raise ConfigError(f"scheduler.kv_wire_in_dc: {e}") from None


@dataclass(frozen=True)
class GatewayConfig:
    """The front door (services/gateway/auth.py): API keys come from PDD_API_KEYS /
    PDD_ADMIN_KEYS and `keys_file`; with none the gateway is open (the demo)."""

    keys_file: str = ""  # YAML list of {name, sha256, scope, max_concurrent, tokens_per_minute, cache_salt}
    # the limits of a key that names none (every PDD_API_KEYS/PDD_ADMIN_KEYS key, a file key
    # without the field): a leaked key cannot take the whole gateway; 0 here means no limit
    default_max_concurrent: int = 32
    default_tokens_per_minute: int = 1_000_000
    metrics_need_key: bool = True  # with keys on, /metrics needs one too (the dashboard always does)
    # no keys is the one-host demo's front door: on any address but loopback the gateway refuses to
    # start without keys, unless this says that serving anyone who can reach it is meant
    allow_open: bool = False
    pdd_object: str = "redacted"  # what user (non-admin) keys get: full | redacted | none
    # each client connection's kernel send buffer (SO_SNDBUF; 0: the kernel's own, autotuned up to
    # a few MB): what a client that stops reading is sent before a write waits (timeouts.client_s)
    send_buffer_kib: int = 256

    def __post_init__(self) -> None:
        if self.pdd_object not in ("full", "redacted", "none"):
            raise ConfigError(f"gateway.pdd_object {self.pdd_object!r} must be full, redacted or none")
        if self.send_buffer_kib < 0:
            raise ConfigError(f"gateway.send_buffer_kib must be >= 0, got {self.send_buffer_kib}")
        for name in ("default_max_concurrent", "default_tokens_per_minute"):
            if getattr(self, name) < 0:
                raise ConfigError(f"gateway.{name} must be >= 0 (0: no limit), got {getattr(self, name)}")


@dataclass(frozen=True)
class ControlPlaneConfig:
    """How many of each control-plane process run (docs/ha.md): the gateways and schedulers are
    active-active (submissions shared through a NATS queue group, plans and the line's backlog
    shared through Redis and the bus), each site's NATS is a cluster of `nats_servers`, and Redis
    has `redis_replicas` with `sentinels` watching it (clients follow a failover). One of each is
    the single-host demo. `ports` is filled by the launcher: the extra processes' and servers'
    ports by name (`gateway-1`, `scheduler-1`, `nats-A-1`, `nats-A-1-route`, `nats-A-1-leaf`,
    `redis-1`, `sentinel-0`, ...); a real site names them, and the servers' `hosts`."""

    gateways: int = 1
    schedulers: int = 1
    nats_servers: int = 1  # per site; more than one: clustered (routes between them)
    redis_replicas: int = 0
    sentinels: int = 0  # Redis Sentinels (needed, and at least one, when there are replicas)
    sentinel_down_ms: int = 1000  # a primary silent this long is failed over
    redis_master: str = "pdd"  # the name the Sentinels know the primary by
    ports: dict[str, int] = field(default_factory=dict)
    # where each NATS server of a clustered site is reached by the others of its site, by name
    # (`nats-A-1: nats-a-1.internal`); "" or absent: 127.0.0.1 (every server on one host)
    hosts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("gateways", "schedulers", "nats_servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"control_plane.{name} must be >= 1, got {getattr(self, name)}")
        if self.redis_replicas < 0 or self.sentinels < 0:
            raise ConfigError("control_plane: redis_replicas and sentinels must be >= 0")
        if self.redis_replicas and not self.sentinels:
            raise ConfigError("control_plane: Redis replicas need sentinels (>= 1) to fail over to them")

    @staticmethod
    def names(kind: str, n: int) -> list[str]:
        """Process names of `n` of a kind: `gateway` alone, else `gateway-0`, `gateway-1`, ..."""
        return [kind] if n == 1 else [f"{kind}-{i}" for i in range(n)]

    @property
    def gateway_names(self) -> list[str]:
        return self.names("gateway", self.gateways)

    @property
    def scheduler_names(self) -> list[str]:
        return self.names("scheduler", self.schedulers)

    @property
    def replica_names(self) -> list[str]:
        return [f"redis-{k}" for k in range(1, self.redis_replicas + 1)]

    @property
    def sentinel_names(self) -> list[str]:
        return [f"sentinel-{i}" for i in range(self.sentinels)]


@dataclass(frozen=True)
class NatsServer:
    """One NATS server of a site: the first one's ports are the site's own (`nats_port`,
    `leaf_port`), the others' are in control_plane.ports; `route_port` 0: not clustered."""

    name: str
    dc: str
    port: int
    route_port: int = 0
    leaf_port: int = 0  # the scheduler's site: where the other sites' servers join


@dataclass(frozen=True)
class ClusterConfig:
    model: str = "default"
    device: str = ""  # when set, every instance's device (`pdd up --device cuda`)
    block_size: int = 16
    host: str = "127.0.0.1"  # where services listen
    port: int = 8000
    control_dc: str = "A"  # where the gateway, the scheduler and Redis run
    datacenters: tuple[DatacenterConfig, ...] = ()
    nats_url: str = ""  # this process's NATS server, overriding its datacenter's (PDD_NATS_URL)
    redis_url: str = ""  # "" = embedded redis-server on a free port
    redis_port: int = 0
    # "host:port,..." of the Redis Sentinels: clients ask them for the primary (control_plane's
    # redis_master) and follow a failover; "" = redis_url is the one Redis (PDD_REDIS_SENTINELS)
    redis_sentinels: str = ""
    # this process's bundle of `pdd certs`'s folder, or the whole folder (`pdd up`, which points each
    # process at its own bundle); "" = `pdd up` makes a throwaway set
    secrets_dir: str = ""
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    max_queue: int = 64  # requests admitted and not finished, per gateway
    max_migrations: int = 2  # times a request may move after the instance serving it died
    # who streams a request's first token: "prefill", in the scheduler's site, the moment it is
    # sampled (its TTFT never waits on the line), or "decoder", once its KV arrived (as naive
    # cross-DC PD does: the bench's pd-wan baselines)
    first_token: str = Role.PREFILL.value
    # a finished request's prompt and answer go back to the prefill that served it, which computes
    # the answer's KV into its prefix cache while idle: the session's next turn, whose prompt holds
    # that answer, does not prefill it again (token ids cross, never KV: the handoff in reverse)
    warm_prefill: bool = True
    # prefill pushes each chunk of a long prompt's KV as soon as its engine computed it, so the push
    # crosses the line while the rest prefills; off by default: on a CPU the push's encoding and
    # TLS (and here the emulated line) take prefill's cores, and a 2,000-token prompt's TTFT on a
    # 2-core host grew by 30% for a second token 24% sooner (docs/kv-wire.md). On where prefill
    # computes on an accelerator and the transfer has cores of its own.
    stream_kv: bool = False
    # under `p-md` (main-decode across the line makes the second token, no relay) a prompt whose
    # KV to push is at most this many tokens (a later turn's new text) sends it layer by layer
    # while its forward computes it, so the line carries it meanwhile: the second token no longer
    # waits for the whole push after the first (agentic, p-md: second token P50 382 -> 291 ms,
    # first token 168 -> 188 ms, on one 2-core host that also runs the line and main-decode;
    # docs/kv-wire.md). With `stream_kv` every prompt's last chunk goes so. 0: never (nor with it).
    stream_layers_max_tokens: int = 256
    # instances with `threads: auto` on one host lend each other their cores: one that steps while
    # the others have no work runs on all of them (`pdd up`'s main-decode decodes on both cores
    # while the relay is idle), and on its share otherwise (shared/cores.py)
    lend_idle_cores: bool = True
    # and a decoder among them waits, before each step, while a prefill there computes a prompt,
    # at most this long: the prompt gets every core, as in one engine's mixed step (shared/cores.py);
    # the decoder's running streams pause meanwhile. 0: decoders step beside the prompt
    yield_to_prefill_s: float = 1.0
    wan: WanConfig = field(default_factory=WanConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    control_plane: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    instances: tuple[InstanceConfig, ...] = ()

    def instance(self, instance_id: str | None, role: str | None = None) -> InstanceConfig:
        for inst in self.instances:
            if (instance_id is None or inst.id == instance_id) and (role is None or inst.role == role):
                return inst
        raise ConfigError(f"no instance {instance_id!r} (role {role}) in the config")

    def of_role(self, role: str) -> list[InstanceConfig]:
        return [i for i in self.instances if i.role == role]

    def datacenter(self, name: str) -> DatacenterConfig:
        for dc in self.datacenters:
            if dc.name == name:
                return dc
        raise ConfigError(f"no datacenter {name!r} in the config (have {[d.name for d in self.datacenters]})")

    def gateway_port(self, name: str) -> int:
        """The HTTP port of gateway `name` (the first one's is `port`)."""
        return self.port if name == self.control_plane.gateway_names[0] else self.control_plane.ports[name]

    def scheduler_metrics_port(self, name: str) -> int:
        first = name == self.control_plane.scheduler_names[0]
        return self.scheduler.metrics_port if first else self.control_plane.ports.get(name, 0)

    def nats_url_for(self, dc: str) -> str:
        """The NATS server a process in datacenter `dc` connects to (only its own site's)."""
        url = self.nats_url or self.datacenter(dc).nats_url
        if not url:
            raise ConfigError(f"no NATS server for datacenter {dc}: set PDD_NATS_URL or datacenters.{dc}.nats_url")
        return url

    def nats_servers(self, dc: str) -> list[NatsServer]:
        """Site `dc`'s NATS servers: `nats-<dc>` alone, or a cluster `nats-<dc>-0`, `-1`, ..."""
        site, ports, n = self.datacenter(dc), self.control_plane.ports, self.control_plane.nats_servers
        if n == 1:
            return [NatsServer(f"nats-{dc}", dc, site.nats_port, 0, site.leaf_port)]
        home = dc == self.control_dc
        return [
            NatsServer(
                name := f"nats-{dc}-{k}",
                dc,
                site.nats_port if k == 0 else ports.get(name, 0),
                ports.get(f"{name}-route", 0),
                (site.leaf_port if k == 0 else ports.get(f"{name}-leaf", 0)) if home else 0,
            )
            for k in range(n)
        ]

    def wan_forwards(self) -> list[tuple[str, str, tuple[str, int]]]:
        """What crosses the line: (forward name, the site that dials, the endpoint it reaches).
        Each decoder outside the scheduler's site takes KV pushes from prefill; each other site's
        NATS servers join the scheduler's site's leafnode ports (`nats-<dc>` the first server's,
        `nats-<dc>-<k>` the k-th's, when that site's NATS is a cluster). Nothing else crosses."""
        home = self.datacenter(self.control_dc)
        out = [
            (i.id, self.control_dc, (i.host or self.host, i.kv_port))
            for i in self.instances
            if i.dc != self.control_dc and i.role != Role.PREFILL
        ]
        for d in self.datacenters:
            if d.name != self.control_dc:
                for k, server in enumerate(self.nats_servers(self.control_dc)):
                    name = f"nats-{d.name}" + (f"-{k}" if k else "")
                    out.append((name, d.name, (home.leaf_host or self.host, server.leaf_port)))
        return out

    def step_tokens_of(self, inst: InstanceConfig) -> int:
        """The most tokens one engine step of the instance computes. An integer is kept; "auto" is
        512 for the decoders (an extend or a catch-up shares their steps with running decodes,
        which wait for it) and for a prefill that streams its KV (each step's KV leaves as it is
        computed); 2,048 for any other prefill, whose steps serve nothing else: every step reads
        all the weights again, and a 2,000-token prompt took 5-7% less time in one step than in
        four of 512 (float32, 2 cores)."""
        if inst.max_step_tokens != AUTO:
            return int(inst.max_step_tokens)
        return 2048 if inst.role == Role.PREFILL and not self.stream_kv else 512

    def threads_of(self, inst: InstanceConfig, cores: int | None = None) -> int:
        """The instance's torch threads. An integer is kept; "auto" is its share of the `cores`
        (default: those this process may run on) of its host, which the instances with the same
        `host` share. The decoders (relay, main-decode) step all the time, so they split the
        cores the explicit ones leave: two OpenMP pools on one core each wait on the other's
        preempted threads. Prefill runs in bursts, so the prefill instances split every core the
        explicit prefills leave, the decoders' too: theirs sleep while idle (the launcher's
        `cores.openmp_env`) and a 2,000-token prompt's TTFT on a 2-core host fell from 6.4 s
        to 3.7 s, its TPOT from 54 to 46 ms. While the others have no work, an instance may take
        every core (`lend_idle_cores`, shared/cores.py). A CUDA instance's host thread only feeds
        the device: 1."""
        if inst.threads != AUTO:
            return int(inst.threads)
        if (self.device or inst.device) != "cpu":
            return 1
        cores = cores or len(os.sched_getaffinity(0))
        group = [
            i
            for i in self.instances
            if (i.role == Role.PREFILL) == (inst.role == Role.PREFILL)
            and (i.host or self.host) == (inst.host or self.host)
            and (self.device or i.device) == "cpu"
        ]
        taken = sum(int(i.threads) for i in group if i.threads != AUTO)
        return max(1, (cores - taken) // sum(1 for i in group if i.threads == AUTO))

    def core_boards(self) -> list[list[InstanceConfig]]:
        """The groups of instances that lend each other their idle cores (shared/cores.py): per
        host, those whose threads are "auto" on the CPU, where there are two or more; none with
        `lend_idle_cores` off. Read before `threads` are resolved (the launcher's)."""
        if not self.lend_idle_cores:
            return []
        hosts: dict[str, list[InstanceConfig]] = {}
        for i in self.instances:
            if i.threads == AUTO and (self.device or i.device) == "cpu":
                hosts.setdefault(i.host or self.host, []).append(i)
        return [group for group in hosts.values() if len(group) > 1]

    def kv_endpoint(self, inst: InstanceConfig) -> tuple[str, int]:
        """Where prefill dials a decoder's KV listener: the emulated line's forward when the
        decoder is in the other site and the line is emulated, else the decoder itself."""
        if self.wan.enabled and inst.dc != self.control_dc and inst.id in self.wan.ports:
            return self.wan.host or self.host, self.wan.ports[inst.id]
        return inst.host or self.host, inst.kv_port


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(names)
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {sorted(unknown)}; known: {sorted(names)}")
    kwargs = {}
    for key, value in raw.items():
        if key == "schedule":
            value = tuple(tuple(float(x) for x in pair) for pair in value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_config(path: str | Path | None = None, **overrides: Any) -> ClusterConfig:
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    return config_from_dict(raw, where=str(path), **overrides)


def config_from_dict(raw: dict[str, Any], where: str = "config", **overrides: Any) -> ClusterConfig:
    """`overrides` replace top-level settings; a section given as a dict (`scheduler={...}`) is
    merged into the file's section, key by key."""
    raw = dict(raw)
    for key, value in overrides.items():
        raw[key] = {**(raw.get(key) or {}), **value} if isinstance(value, dict) else value
    wan = _build(WanConfig, raw.pop("wan", {}) or {}, f"{where}: wan")
    timeouts = _build(Timeouts, raw.pop("timeouts", {}) or {}, f"{where}: timeouts")
    handoff = _build(HandoffConfig, raw.pop("handoff", {}) or {}, f"{where}: handoff")
    scheduler = _build(SchedulerConfig, raw.pop("scheduler", {}) or {}, f"{where}: scheduler")
    gateway = _build(GatewayConfig, raw.pop("gateway", {}) or {}, f"{where}: gateway")
    control = _build(ControlPlaneConfig, raw.pop("control_plane", {}) or {}, f"{where}: control_plane")
    instances = tuple(_build(InstanceConfig, i, f"{where}: instance") for i in raw.pop("instances", []))
    dcs = raw.pop("datacenters", None) or {d: {} for d in sorted({i.dc for i in instances} | {wan.src_dc, wan.dst_dc})}
    datacenters = tuple(
        _build(DatacenterConfig, {"name": name, **(v or {})}, f"{where}: datacenters.{name}")
        for name, v in (dcs.items() if isinstance(dcs, dict) else ((d["name"], d) for d in dcs))
    )
    env = {
        "nats_url": os.environ.get("PDD_NATS_URL"),
        "redis_url": os.environ.get("PDD_REDIS_URL"),
        "redis_sentinels": os.environ.get("PDD_REDIS_SENTINELS"),
        "secrets_dir": os.environ.get("PDD_SECRETS_DIR"),
        "port": os.environ.get("PDD_PORT"),
        "model": os.environ.get("PDD_MODEL"),
    }
    for key, value in env.items():
        if value:
            raw[key] = int(value) if key == "port" else value
    cfg = _build(
        ClusterConfig,
        {
            **raw,
            "wan": wan,
            "timeouts": timeouts,
            "handoff": handoff,
            "scheduler": scheduler,
            "gateway": gateway,
            "control_plane": control,
            "instances": instances,
            "datacenters": datacenters,
        },
        where,
    )
    if cfg.device:
        check_device(cfg.device, where)
    if cfg.first_token not in FIRST_TOKEN_FROM:
        raise ConfigError(f"{where}: first_token must be one of {list(FIRST_TOKEN_FROM)}, got {cfg.first_token!r}")
    if cfg.stream_layers_max_tokens < 0:
        raise ConfigError(
            f"{where}: stream_layers_max_tokens must be >= 0 (0: never), got {cfg.stream_layers_max_tokens}"
        )
    if not cfg.yield_to_prefill_s >= 0:
        raise ConfigError(f"{where}: yield_to_prefill_s must be >= 0 (0: never), got {cfg.yield_to_prefill_s}")
    ids = [i.id for i in cfg.instances]
    if len(ids) != len(set(ids)):
        raise ConfigError(f"{where}: instance ids must be unique, got {ids}")
    for role in (Role.PREFILL, Role.MD):
        if not cfg.of_role(role):
            raise ConfigError(f"{where}: needs at least one {role} instance")
    known = {d.name for d in cfg.datacenters}
    for dc in {i.dc for i in cfg.instances} | {cfg.control_dc}:
        if dc not in known:
            raise ConfigError(f"{where}: datacenter {dc!r} is used but not in datacenters {sorted(known)}")
    if cfg.scheduler.default_pipeline == Pipeline.P_RLD_MD and not cfg.of_role(Role.RLD):
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, default_pipeline=Pipeline.P_MD.value)
        )
    return cfg


def serving_problems(cfg: ClusterConfig, role: str, instance: str | None) -> list[str]:
    """Why `role` (instance `instance`) cannot run from this config alone, one line each:
    what `pdd serve` says instead of starting a service that would fail later."""
    problems = []
    dc = cfg.control_dc if role in ("gateway", "scheduler", "wanlink") else None
    if dc is None:
        try:
            dc = cfg.instance(instance, role).dc
        except ConfigError as e:
            return [str(e)]
    if role != "wanlink" and not (cfg.nats_url or cfg.datacenter(dc).nats_url):
        problems.append(f"no NATS server for datacenter {dc}: set PDD_NATS_URL or datacenters.{dc}.nats_url")
    if role in ("gateway", "scheduler") and not cfg.redis_url:
        problems.append("no Redis: set PDD_REDIS_URL (Redis runs in the scheduler's datacenter)")
    if not cfg.secrets_dir:
        problems.append(
            "no certificates or credentials: set PDD_SECRETS_DIR or secrets_dir (make them with "
            "`pdd certs`); every link between sites is encrypted and authenticated"
        )
    return problems


def to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    """Plain data (for YAML round trips, e.g. the launcher handing a config to its children):
    a role is its plain name again."""
    out = dataclasses.asdict(cfg, dict_factory=lambda items: {k: _plain(v) for k, v in items})
    out["datacenters"] = {d.pop("name"): d for d in out["datacenters"]}
    return out


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def service_args(role: str, argv: list[str] | None = None) -> tuple[ClusterConfig, str | None]:
    """`python -m services.<role> --config FILE [--instance ID]`: logging set up, config loaded."""
    import argparse

    from shared.logs import setup_logging

    parser = argparse.ArgumentParser(prog=f"services.{role}")
    parser.add_argument("--config", default=None, help="cluster YAML (default configs/single-host.yaml)")
    parser.add_argument("--instance", default=None, help="instance id (roles with several instances)")
    args = parser.parse_args(argv)
    setup_logging(args.instance or role)
    return load_config(args.config), args.instance
