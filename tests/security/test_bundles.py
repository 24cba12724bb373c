"""One process's bundle is not the cluster's secrets (issue #41): the attacker holds every file of
one bundle that `pdd certs` wrote (shared/security.py), tries every string in it against every
NATS user and Redis login of a real two-site cluster's servers, started as `pdd up` starts them
(`Cluster.start_servers`: each site's NATS from its site bundle, Redis with the ACL users of
pdd/redisconf.py), and tries what a login may do beyond its role. docs/deploy.md ("What each
plane trusts") names each.

Before bundles, `credentials.json` held every password and every process read it: each attempt
below succeeded.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import socket
import ssl
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import nkeys
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdd.launcher import Cluster
from pdd.redisconf import REDIS_USERS
from pdd.servers import redis_has_selectors
from shared import subjects
from shared.config import ConfigError, load_config
from shared.messages import Abort
from shared.registry import Registry
from shared.security import Secrets
from tests.helpers import until

NO_RETRY = Retry(NoBackoff(), 0)  # a refused login is an answer, not a fault to retry
INSTANCES = {"prefill-0": "A", "rld-0": "A", "md-0": "B", "md-1": "B"}
CONTROL = ("gateway", "scheduler", "wanlink", "operator")


@pytest.fixture(scope="module")
def sites() -> Iterator[Cluster]:
    """Both sites' NATS servers (B joined to A's leafnode port) and Redis, no processes."""
    instances = [{"id": i, "role": i.split("-")[0], "dc": dc} for i, dc in INSTANCES.items()]
    cluster = Cluster({"instances": instances, "wan": {"enabled": False}}, log=lambda *_: None)
    try:
        cluster.start_servers()
        yield cluster
    finally:
        cluster.stop()


def bundle(cluster: Cluster, name: str) -> Path:
    return cluster.secrets.bundle(name).directory


def harvest(folder: Path) -> set[str]:
    """Every string in every credentials file of `folder`: what its holder can try as a password."""

    def strings(node) -> Iterator[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            for key, value in node.items():
                yield key
                yield from strings(value)
        elif isinstance(node, list):
            for value in node:
                yield from strings(value)

    return {s for path in folder.rglob("*.json") for s in strings(json.loads(path.read_text()))}


def nats_login(url: str, user: str, password: str = "", seed: str = "") -> bool:
    """Whether the server at `url` takes this login, `user` with `password` or an NKEY `seed`
    signing the server's nonce: its protocol by hand, CONNECT then PING (nats-py takes a second
    or more over each refusal; this is one round trip)."""
    host, port = url.removeprefix("nats://").split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock, sock.makefile("rwb") as wire:
        info = wire.readline()
        assert info.startswith(b"INFO ")
        connect = {"user": user, "pass": password, "verbose": False, "pedantic": False, "protocol": 1}
        if seed:
            key = nkeys.from_seed(bytearray(seed.encode()))
            nonce = json.loads(info.removeprefix(b"INFO "))["nonce"]
            connect = connect | {
                "nkey": key.public_key.decode(),
                "sig": base64.b64encode(key.sign(nonce.encode())).decode(),
            }
        wire.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        wire.flush()
        answer = wire.readline()
    assert answer.startswith((b"PONG", b"-ERR")), answer
    return answer.startswith(b"PONG")


def is_seed(s: str) -> bool:
    try:
        nkeys.from_seed(bytearray(s.encode()))
        return True
    except Exception:
        return False


def nats_logins(cluster: Cluster, users: list[str], stolen: set[str]) -> list[str]:
    """The `user@site` logins the strings in `stolen` open on the sites' NATS servers: each tried
    as every user's password, and each NKEY seed among them signing the nonce (a login as the
    user whose public key it is)."""
    owner = {cluster.secrets.nats_public_key(u): u for u in every_nats_user()}
    seeds = {s for s in stolen if is_seed(s)}
    opened = []
    for dc in ("A", "B"):
        url = cluster.nats_url(dc)
        for user in users:
            mine = [s for s in seeds if owner.get(nkeys.from_seed(bytearray(s.encode())).public_key.decode()) == user]
            if any(nats_login(url, user, password=p) for p in stolen) or any(nats_login(url, "", seed=s) for s in mine):
                opened.append(f"{user}@{dc}")
    return opened


def test_every_seed_in_a_bundle_is_its_own_processes_and_no_site_bundle_holds_one(sites):
    """A process's bundle holds its own NKEY seed alone; a site's servers hold public keys only."""
    for name in [*INSTANCES, *CONTROL]:
        assert sorted(s for s in harvest(bundle(sites, name)) if is_seed(s)) == [
            sites.secrets.nats_login(name)["nkeys_seed_str"]
        ]
    for dc in ("A", "B"):
        assert [s for s in harvest(bundle(sites, f"site-{dc}")) if is_seed(s)] == []
        assert nats_logins(sites, every_nats_user(), harvest(bundle(sites, f"site-{dc}"))) == []


def redis_logins(cluster: Cluster, passwords: set[str]) -> list[str]:
    """The Redis logins (user, or `(no password)`) that `passwords` open."""
    port = cluster.cfg.redis_port
    opened = []
    try:
        redis.Redis(port=port, socket_timeout=2, retry=NO_RETRY).ping()
        opened.append("(no password)")
    except redis.AuthenticationError:
        pass
    for user in (*REDIS_USERS, "md-0"):
        for password in passwords:
            client = redis.Redis(port=port, username=user, password=password, socket_timeout=2, retry=NO_RETRY)
            try:
                client.ping()
                opened.append(user)
            except redis.AuthenticationError:
                pass
            finally:
                client.close()
    return opened


def every_nats_user() -> list[str]:
    return [*INSTANCES, *CONTROL, "leaf", "route"]


# -- with md-0's bundle alone ---------------------------------------------------------------------
def test_md0s_bundle_logs_in_to_nats_as_itself_and_no_other_user(sites):
    stolen = harvest(bundle(sites, "md-0"))
    others = [u for u in every_nats_user() if u != "md-0"]
    assert nats_logins(sites, ["md-0"], stolen) == ["md-0@B"]  # its own works: the harvest is real
    assert nats_logins(sites, others, stolen) == []


@pytest.mark.parametrize("instance", INSTANCES)
def test_no_instances_bundle_reaches_redis(sites, instance):
    """md-0's, and every model instance's: they report over NATS, and have no Redis login at all."""
    stolen = harvest(bundle(sites, instance))
    assert redis_logins(sites, stolen) == []


def test_md0s_bundle_holds_its_own_key_alone(sites):
    keys = sorted(str(p.relative_to(bundle(sites, "md-0"))) for p in bundle(sites, "md-0").rglob("*.key"))
    assert keys == ["kv/md-0.key"]


# -- with the gateway's bundle alone --------------------------------------------------------------
def test_gateways_bundle_holds_no_private_key(sites):
    folder = bundle(sites, "gateway")
    assert [p.name for p in folder.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()] == []


def test_gateways_bundle_opens_no_decoder_scheduler_or_operator_login(sites):
    stolen = harvest(bundle(sites, "gateway"))
    assert nats_logins(sites, ["gateway"], stolen) == ["gateway@A"]
    assert nats_logins(sites, [u for u in every_nats_user() if u != "gateway"], stolen) == []
    assert redis_logins(sites, stolen) == ["gateway"]  # its own; not `default`, the operator's


def test_site_bs_bundle_holds_no_redis_login_and_no_site_as_key(sites):
    folder = bundle(sites, "site-B")
    assert redis_logins(sites, harvest(folder)) == []
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.key")) == ["nats/B.key"]


# -- each Redis login does its role's work and nothing else ---------------------------------------
def _refused(client: redis.Redis, *command) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def login(cluster: Cluster, name: str) -> redis.Redis:
    secrets = cluster.secrets.bundle(name)
    return redis.Redis(port=cluster.cfg.redis_port, username=secrets.redis_user, password=secrets.redis_password)


OUTSIDE_EVERY_ROLE = [
    ("FLUSHALL",),
    ("CONFIG", "SET", "dir", "/tmp"),
    ("ACL", "SETUSER", "gateway", "+@all", "~*"),
    ("ACL", "LIST"),
    ("KEYS", "*"),
    ("SAVE",),
    ("SET", "elsewhere", "1"),
]
GATEWAY_DENIED = [
    ("SET", "pdd:plan:req-1", "forged"),  # a request's plan: where its KV goes
    ("GET", "pdd:plan:req-1"),
    ("SADD", "pdd:kv:md-0", "hash"),  # the prefix index: where requests are routed
    ("DEL", "pdd:kv:md-0"),
    ("SET", "pdd:adopted:req-1", "1"),
    ("HSET", "pdd:process:scheduler:s", "pid", "1"),  # another process's presence
    ("SET", "pdd:instance:md-0", "x"),  # no SET at all
]


@pytest.mark.parametrize("command", OUTSIDE_EVERY_ROLE + GATEWAY_DENIED, ids=lambda c: " ".join(c[:2]))
def test_the_gateways_login_is_refused_outside_its_role(sites, command):
    assert _refused(login(sites, "gateway"), *command)


def test_the_gateways_login_does_its_work(sites):
    operator, gateway = login(sites, "operator"), login(sites, "gateway")
    operator.hset("pdd:instance:md-0", mapping={"id": "md-0", "addr": "10.0.0.9:7500"})
    operator.sadd("pdd:instances", "md-0", "gone-0")
    operator.hset("pdd:request:req-1", "plan", "x")
    assert gateway.hgetall("pdd:instance:md-0")[b"addr"] == b"10.0.0.9:7500"
    assert gateway.srem("pdd:instances", "gone-0") == 1 and gateway.delete("pdd:request:req-1") == 1
    assert gateway.hset("pdd:process:gateway:gateway", "pid", "1") == 1
    if redis_has_selectors():  # Redis 7: its rows are read-only to it (6.2 has no per-key access)
        assert _refused(gateway, "HSET", "pdd:instance:md-0", "addr", "evil:7500")


@pytest.mark.parametrize("command", OUTSIDE_EVERY_ROLE, ids=lambda c: " ".join(c[:2]))
def test_the_schedulers_login_is_refused_outside_its_role(sites, command):
    assert _refused(login(sites, "scheduler"), *command)


@pytest.mark.parametrize("command", [("GET", "pdd:plan:req-1"), ("HSET", "pdd:instance:md-0", "addr", "x")])
def test_the_replication_login_reads_and_writes_no_key(sites, command):
    assert _refused(login(sites, "site-A"), *command)


# -- the leaf connection between the sites --------------------------------------------------------
def _leaf_handshake(cluster: Cluster, cert: tuple[Path, Path]) -> bytes:
    """What A's leafnode port says to a server presenting `cert` (TLS first, as the leaf does):
    its INFO once it took the certificate, b"" or a TLS alert once it refused it."""
    ctx = ssl.create_default_context(cafile=str(cluster.secrets.ca))
    ctx.check_hostname = False
    ctx.load_cert_chain(*map(str, cert))
    port = cluster.cfg.nats_servers("A")[0].leaf_port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        try:
            return tls.recv(4096)
        except (ssl.SSLError, ConnectionResetError) as e:
            return f"refused: {e}".encode()


def test_only_site_bs_certificate_joins_as_the_leaf(sites):
    assert _leaf_handshake(sites, sites.secrets.cert("nats", "B")).startswith(b"INFO")
    for other in (sites.secrets.cert("kv", "md-0"), sites.secrets.cert("nats", "A")):  # signed by the CA too
        assert not _leaf_handshake(sites, other).startswith(b"INFO")


def test_the_leaf_carries_what_site_bs_instances_use_and_nothing_else(sites):
    """A's prompts for prefill and the scheduler's submissions never reach B, even for a B user
    allowed everything (a compromised site B server); what B's instances take does, in order."""
    login = sites.secrets.nats_login("operator")

    async def crossed(publish_dc: str, listen_dc: str, forbidden: list[str], marker: str) -> list[str]:
        pub = await nats.connect(sites.nats_url(publish_dc), **login)
        sub = await nats.connect(sites.nats_url(listen_dc), **login)
        got: list[str] = []
        done = asyncio.Event()

        async def on(msg) -> None:
            got.append(msg.subject)
            if msg.subject == marker:
                done.set()

        for subject in (*forbidden, marker):
            await sub.subscribe(subject, cb=on)
        await sub.flush()
        for _ in range(100):  # the subscriptions reach the other site over the leaf: until the marker does
            for subject in forbidden:
                await pub.publish(subject, b"probe")
            await pub.publish(marker, Abort(f"probe-{uuid.uuid4().hex}").encode())
            try:
                await asyncio.wait_for(done.wait(), 0.2)
                break
            except TimeoutError:
                continue
        await pub.close()
        await sub.close()
        return got

    a_to_b = [subjects.prefill_task("prefill-0"), subjects.SUBMIT, subjects.decode_task("rld-0"), "_INBOX.gateway.x"]
    got = asyncio.run(crossed("A", "B", a_to_b, subjects.decode_task("md-0")))
    assert got and set(got) == {subjects.decode_task("md-0")}
    b_to_a = [subjects.SUBMIT, subjects.prefill_task("prefill-0"), subjects.heartbeat("prefill-0"), "evil.x"]
    got = asyncio.run(crossed("B", "A", b_to_a, subjects.heartbeat("md-0")))
    assert got and set(got) == {subjects.heartbeat("md-0")}


# -- the launcher gives each process its own bundle -----------------------------------------------
def test_each_process_is_pointed_at_its_own_bundle(sites, monkeypatch):
    for name, spec in sites.specs.items():
        monkeypatch.setenv("PDD_SECRETS_DIR", sites.process_env(name)["PDD_SECRETS_DIR"])
        secrets = Secrets.of(load_config(sites.config_path))
        own = name if name in INSTANCES else spec.role
        assert set(harvest(secrets.directory)) >= {own}, name
        assert list(json.loads((secrets.directory / "credentials.json").read_text())["nkeys"]) == [own], name


# -- replicated Redis: the replica and the Sentinel log in as `replication`, clients as themselves -
@pytest.fixture(scope="module")
def replicated() -> Iterator[Cluster]:
    """Site A's Redis with a replica and a Sentinel, as `pdd up` starts a replicated control plane."""
    instances = [{"id": i, "role": i.split("-")[0], "dc": dc} for i, dc in INSTANCES.items()]
    plane = {"redis_replicas": 1, "sentinels": 1}
    cluster = Cluster({"instances": instances, "wan": {"enabled": False}, "control_plane": plane}, log=lambda *_: None)
    try:
        cluster.start_servers()
        yield cluster
    finally:
        cluster.stop()


def _at(cluster: Cluster, name: str, port: int) -> redis.Redis:
    secrets = cluster.secrets.bundle(name)
    return redis.Redis(port=port, username=secrets.redis_user, password=secrets.redis_password, retry=NO_RETRY)


def test_the_replica_and_the_sentinel_follow_the_primary_with_the_replication_login(replicated):
    plane = replicated.cfg.control_plane
    operator = _at(replicated, "operator", plane.ports["redis-1"])
    synced = lambda: operator.info("replication")["master_link_status"] == "up"  # noqa: E731
    asyncio.run(until(synced, what="the replica's first sync with the replication login"))
    sentinel = _at(replicated, "gateway", plane.ports["sentinel-0"])
    master = plane.redis_master
    assert (
        sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", master)[1] == b"%d" % replicated.cfg.redis_port
    )


@pytest.mark.parametrize(
    "command",
    [
        ("SENTINEL", "SET", "pdd", "down-after-milliseconds", "1"),
        ("SENTINEL", "REMOVE", "pdd"),
        ("SENTINEL", "FAILOVER", "pdd"),
        ("SENTINEL", "MONITOR", "evil", "127.0.0.1", "1", "1"),
        ("ACL", "LIST"),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_sentinel_answers_the_gateway_where_the_primary_is_and_nothing_else(replicated, command):
    """Else its login could point every client at a Redis of its own (SENTINEL MONITOR/SET)."""
    assert _refused(_at(replicated, "gateway", replicated.cfg.control_plane.ports["sentinel-0"]), *command)


@pytest.mark.parametrize("process", ["gateway", "scheduler"])
def test_the_registry_reaches_the_primary_through_the_sentinel_with_its_own_login(replicated, process):
    """The way the gateway and the schedulers connect (shared/registry.py): the Sentinel asked
    with their login, then the primary."""
    cfg = dataclasses.replace(replicated.cfg, secrets_dir=str(bundle(replicated, process)))

    async def ask() -> list:
        registry = Registry.of(cfg)
        try:
            return await registry.alive()
        finally:
            await registry.r.aclose()

    assert cfg.redis_sentinels and asyncio.run(ask()) == []


def test_a_process_with_no_bundle_in_the_set_is_refused_not_given_the_whole_set(sites):
    with pytest.raises(ConfigError, match="no bundle 'md-9'"):
        sites.secrets.bundle("md-9")
