"""Redis ACL users per role: each login runs only the commands, on only the keys, its process
uses (shared/registry.py names the keys). Model instances have no login: they report over NATS
and the scheduler's registrar writes Redis for them.

    default      the operator (`pdd status`, the tests): everything; its password is in
                 DIR/operator/ alone, and no password is no login
    gateway      reads the instances' rows and the epoch, drops expired ids from the set, ends
                 requests' records, writes its own presence
    scheduler    the registrar and the planner: reads and writes the cluster's keys (`pdd:*`),
                 runs the registry's scripts; no admin, no FLUSH, no KEYS, no CONFIG
    replication  what Redis's replicas and Sentinels present to each other (`masteruser`,
                 `sentinel auth-user`): replication and failover only

Redis 7's selectors mark a key read-only (`%R~`); the launcher's embedded Redis 6.2 has none,
so there a key a login may touch it may also write with the commands it has: the gateway may
HSET an instance's row there (it holds HSET for its own presence), not in a Redis 7 site.
"""

from __future__ import annotations

from shared.security import Secrets

REDIS_USERS = ("default", "gateway", "scheduler", "replication")
_CONNECTION = ["+ping", "+hello", "+multi", "+exec", "+discard"]
_SCRIPTS = ["+evalsha", "+eval", "+script|load"]
# (key pattern, R / W / RW) per login; `&` channels: none but the Sentinels'
KEYS: dict[str, list[tuple[str, str]]] = {
    "gateway": [
        ("pdd:instance:*", "R"),
        ("pdd:instances", "RW"),  # alive() drops the ids of expired rows
        ("pdd:epoch", "R"),
        ("pdd:request:*", "W"),  # a finished request's record
        ("pdd:process:gateway:*", "RW"),
    ],
    "scheduler": [("pdd:*", "RW")],
}
COMMANDS: dict[str, list[str]] = {
    "gateway": [*_CONNECTION, *_SCRIPTS, "+smembers", "+srem", "+hgetall", "+exists", "+get", "+del"]
    + ["+hset", "+pexpire"],
    "scheduler": ["+@read", "+@write", "+@transaction", "-@dangerous", *_CONNECTION, *_SCRIPTS, "+wait"],
}
_REPLICATION = ["+psync", "+replconf", "+ping", "+multi", "+exec", "+slaveof", "+replicaof", "+config|rewrite"]
_REPLICATION += ["+role", "+publish", "+subscribe", "+info", "+client|setname", "+client|kill", "+script|kill"]
_SENTINEL_CLIENT = ["+ping", "+hello"]
_SENTINEL_CLIENT += [f"+sentinel|{s}" for s in ("get-master-addr-by-name", "masters", "master", "sentinels")]
_SENTINEL_CLIENT += ["+sentinel|slaves", "+sentinel|replicas"]


def _keys(user: str, selectors: bool) -> list[str]:
    if not selectors:
        return [f"~{pattern}" for pattern, _ in KEYS[user]]
    return [f"%{access}~{pattern}" for pattern, access in KEYS[user]]


def acl_lines(site: Secrets, selectors: bool) -> list[str]:
    """The `user` lines of a Redis server of the site whose bundle is `site`; `selectors`: the
    server is Redis 7 or later (read-only keys)."""
    hashes = site.redis_users
    lines = [f"user default on #{hashes['default']} ~* &* +@all"]
    for user in ("gateway", "scheduler"):
        lines.append(" ".join([f"user {user} on #{hashes[user]} resetkeys resetchannels -@all"] + COMMANDS[user]))
        lines[-1] += " " + " ".join(_keys(user, selectors))
    lines.append(
        f"user replication on #{hashes['replication']} resetkeys resetchannels &__sentinel__:* -@all "
        + " ".join(_REPLICATION)
    )
    return lines


def server_lines(site: Secrets, selectors: bool) -> list[str]:
    """A Redis server's auth: the users, and the login it presents when it replicates another."""
    return [*acl_lines(site, selectors), f"masteruser {site.redis_user}", f"masterauth {site.redis_password}"]


def sentinel_lines(site: Secrets, master: str) -> list[str]:
    """A Sentinel's auth: who may ask it (the operator everything; the gateway and the scheduler
    where the primary is), and the login it presents to Redis and to the other Sentinels."""
    hashes = site.redis_users
    lines = [f"user default on #{hashes['default']} ~* &* +@all"]
    lines += [
        f"user {u} on #{hashes[u]} resetkeys resetchannels -@all " + " ".join(_SENTINEL_CLIENT)
        for u in ("gateway", "scheduler")
    ]
    lines.append(f"user replication on #{hashes['replication']} ~* &* +@all")
    login, password = site.redis_user, site.redis_password
    lines += [f"sentinel auth-user {master} {login}", f"sentinel auth-pass {master} {password}"]
    return [*lines, f"sentinel sentinel-user {login}", f"sentinel sentinel-pass {password}"]
