"""NATS server configuration per site: users per role, subject permissions, the leafnode link.

Each datacenter runs its own NATS server; its services connect only to it. The scheduler's
site listens for leafnode connections (TLS, client certificates required, a password); every
other site's server joins it as a leafnode through the line, so subjects span both sites while
nothing crosses in the clear; the leaf connection is accepted only with the joining site's own
certificate (pinned) and carries only the subjects that site's instances use. Each process may
publish and subscribe only what it uses (`PERMISSIONS`): a model instance is a user of its own,
whose subjects name it, so md-0 reads no other decoder's tasks and reports as no other instance;
replies to requests it received are always allowed.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.config import ClusterConfig, DatacenterConfig, NatsServer
from shared.pipelines import Role
from shared.security import Secrets

# subjects each user publishes / subscribes (shared/subjects.py names them all); a model instance
# is a user of its own, `{me}` its id: it takes only its own tasks and reports only as itself
_REPORT = ["pdd.registry.{me}.>"]  # heartbeats, index updates, leaving, WAN samples
_OPERATED = ["pdd.abort", "pdd.inspect.{me}", "pdd.admin.{me}.flush"]
PERMISSIONS: dict[str, dict[str, list[str]]] = {
    "gateway": {
        "publish": [
            "pdd.scheduler.submit",
            "pdd.scheduler.status",
            "pdd.abort",
            "pdd.decode.*.resend",
            "pdd.prefill.*.warm",
            "pdd.wanlink.*.control",
        ],
        "subscribe": ["pdd.tokens.>"],
    },
    "scheduler": {
        "publish": [
            "pdd.prefill.*.task",
            "pdd.prefill.*.drop",
            "pdd.decode.*.task",
            "pdd.decode.*.drop",
            "pdd.abort",
            "pdd.scheduler.backlog",
        ],
        "subscribe": [
            "pdd.scheduler.submit",
            "pdd.scheduler.backlog",
            "pdd.scheduler.status",
            "pdd.registry.>",
            "pdd.abort",  # aborts: the line's backlog forgets the request's KV
        ],
    },
    Role.PREFILL: {
        "publish": ["pdd.tokens.>", "pdd.handoff.*.finish", "pdd.decode.*.drop", *_REPORT],
        "subscribe": ["pdd.prefill.{me}.task", "pdd.prefill.{me}.drop", "pdd.prefill.{me}.warm", *_OPERATED],
    },
    Role.RLD: {
        "publish": ["pdd.tokens.>", "pdd.abort", "pdd.handoff.*.chunk", *_REPORT],
        "subscribe": [
            "pdd.decode.{me}.task",
            "pdd.decode.{me}.drop",
            "pdd.decode.{me}.resend",
            "pdd.handoff.{me}.ready",
            "pdd.handoff.{me}.finish",
            *_OPERATED,
        ],
    },
    Role.MD: {
        "publish": ["pdd.tokens.>", "pdd.handoff.*.ready", "pdd.handoff.*.finish", *_REPORT],
        "subscribe": [
            "pdd.decode.{me}.task",
            "pdd.decode.{me}.drop",
            "pdd.decode.{me}.resend",
            "pdd.handoff.{me}.chunk",
            *_OPERATED,
        ],
    },
    "wanlink": {"publish": [], "subscribe": ["pdd.wanlink.*.control"]},
}
CONTROL_USERS = ("gateway", "scheduler", "wanlink")  # the scheduler's site's, beside its instances


def site_users(cfg: ClusterConfig, dc: str) -> dict[str, str]:
    """Site `dc`'s NATS users, each with its permissions' role: every instance of the site by
    its id, and in the scheduler's site the control plane's users."""
    users = {i.id: str(i.role) for i in cfg.instances if i.dc == dc}
    return (dict(zip(CONTROL_USERS, CONTROL_USERS)) if dc == cfg.control_dc else {}) | users


def _leaf_permissions(cfg: ClusterConfig) -> dict:
    """What may cross the leaf connection, from the joining sites' side: what their instances
    publish (and replies to requests from the scheduler's site), and what those instances take
    (and replies to their own requests). Nothing else crosses, whatever a joining server asks."""
    publish, subscribe = {"_INBOX.>"}, set()
    for inst in cfg.instances:
        if inst.dc != cfg.control_dc:
            perms = {
                way: {s.replace("{me}", inst.id) for s in subjects} for way, subjects in PERMISSIONS[inst.role].items()
            }
            publish |= perms["publish"]
            subscribe |= perms["subscribe"] | {f"_INBOX.{inst.id}.>"}
    return {"publish": {"allow": sorted(publish)}, "subscribe": {"allow": sorted(subscribe) or ["pdd.none"]}}


def _user(user: str, role: str, secrets: Secrets) -> dict:
    """A user's entry: its public NKEY (a set from before NKEYs: its password) and its permissions."""
    public = secrets.nats_public_key(user)
    login = {"nkey": public} if public else {"user": user, "password": secrets.nats_password(user)}
    if user == "operator":  # tests, `pdd status`, `pdd wan`: everything
        return login
    perms = {way: [s.replace("{me}", user) for s in subjects] for way, subjects in PERMISSIONS[role].items()}
    return {
        **login,
        "permissions": {
            "publish": {"allow": perms["publish"] or ["pdd.none"]},
            # replies to its own requests come on its own inbox prefix (shared/bus.py)
            "subscribe": {"allow": [*perms["subscribe"], f"_INBOX.{user}.>"]},
            "allow_responses": True,
        },
    }


def _tls(secrets: Secrets, dc: str, mount: Path | None) -> dict:
    """Files as the server will see them: under `mount` when the secrets are mounted elsewhere."""
    where = Secrets(mount) if mount else secrets
    cert, key = where.cert("nats", dc)
    # handshake_first: TLS from the first byte, not even the server's INFO in the clear
    return {
        "cert_file": str(cert),
        "key_file": str(key),
        "ca_file": str(where.ca),
        "timeout": 5,
        "handshake_first": True,
    }


def server_conf(
    cfg: ClusterConfig,
    dc: DatacenterConfig,
    secrets: Secrets | None,
    mount: Path | None = None,
    server: NatsServer | None = None,
) -> str:
    """The config of site `dc`'s NATS server `server` (default: its first), as JSON, which
    nats-server reads as its own format. A site of several servers is one NATS cluster: each
    routes to the others (TLS with the site's certificate, a route password), and every one of
    the scheduler's site takes leafnode connections, so the other site's servers may join any."""
    servers = cfg.nats_servers(dc.name)
    server = server or servers[0]
    conf: dict = {
        "server_name": f"pdd-{dc.name}" if len(servers) == 1 else f"pdd-{server.name.removeprefix('nats-')}",
        "listen": f"{cfg.host}:{server.port or 4222}",
        "max_payload": 1 << 20,
    }
    if dc.monitor_port and server.name == servers[0].name:  # /healthz for container healthchecks
        conf["http_port"] = dc.monitor_port
    home = dc.name == cfg.control_dc
    if secrets is not None:
        users = site_users(cfg, dc.name) | {"operator": "operator"}
        conf["authorization"] = {"users": [_user(u, r, secrets) for u, r in users.items()]}
        if home:  # the other sites' servers join as this user: a leafnode connection, never a client
            leaf = {"user": "leaf", "password": secrets.nats_password("leaf"), "permissions": _leaf_permissions(cfg)}
            conf["authorization"]["users"].append(leaf | {"allowed_connection_types": ["LEAFNODE"]})
    if len(servers) > 1:
        conf["cluster"] = _cluster(cfg, dc, server, servers, secrets, mount)
    if home:
        leaf = {"listen": f"{cfg.host}:{server.leaf_port}"}
        if secrets is not None:
            # a client certificate from our CA, and of those only a joining site's own (its pin)
            pins = {"pinned_certs": secrets.leaf_pins} if secrets.leaf_pins else {}
            # no authorization block of its own: a joining server logs in as the user `leaf` above
            leaf["tls"] = _tls(secrets, dc.name, mount) | {"verify": True} | pins
        conf["leafnodes"] = leaf
    elif dc.leaf_remote:
        creds = f"leaf:{secrets.nats_password('leaf')}@" if secrets else ""
        urls = [f"nats-leaf://{creds}{where}" for where in dc.leaf_remote.split(",")]
        remote: dict = {"urls": urls} if len(urls) > 1 else {"url": urls[0]}
        if secrets is not None:
            remote["tls"] = _tls(secrets, dc.name, mount)  # checks the other site's certificate, presents ours
        conf["leafnodes"] = {"remotes": [remote], "reconnect": 1}
    return json.dumps(conf, indent=2)


def _cluster(
    cfg: ClusterConfig,
    dc: DatacenterConfig,
    me: NatsServer,
    servers: list[NatsServer],
    secrets: Secrets | None,
    mount: Path | None,
) -> dict:
    """The `cluster` block of one server of a clustered site: routes to every other server."""
    creds = f"route:{secrets.route_password}@" if secrets else ""
    hosts = cfg.control_plane.hosts
    cluster: dict = {
        "name": f"pdd-{dc.name}",
        "listen": f"{cfg.host}:{me.route_port}",
        # the others reach it by its name, not an address it happens to have (a pod's IP); its
        # clients keep the site's `nats_url`, which lists every server, rather than learn addresses
        "advertise": f"{hosts.get(me.name) or '127.0.0.1'}:{me.route_port}",
        "no_advertise": True,
        "routes": [
            f"nats-route://{creds}{hosts.get(s.name) or '127.0.0.1'}:{s.route_port}"
            for s in servers
            if s.name != me.name
        ],
    }
    if secrets is not None:
        cluster["authorization"] = {"user": "route", "password": secrets.route_password}
        cluster["tls"] = _tls(secrets, dc.name, mount) | {"verify": True}
        del cluster["tls"]["handshake_first"]  # routes negotiate TLS after INFO
    return cluster
