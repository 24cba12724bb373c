"""Redis: the instance registry (heartbeats with a TTL), load figures, request state, prefix index.

Redis lives in datacenter A. Instances never write it: they report over NATS (heartbeats,
prefix-cache events) and the scheduler's registrar (services/scheduler/registrar.py) writes
them here; the scheduler and the gateway read them.

Keys
    pdd:instance:<id>          hash  InstanceInfo fields; expires unless refreshed by heartbeats
    pdd:instances              set   the ids of those rows (an id whose row expired is dropped on read)
    pdd:request:<id>           hash  plan of an in-flight request; deleted when it ends, renewed
                                     while an instance reports holding it
    pdd:epoch                  str   when this Redis's data began (wall clock of the registrar that
                                     set it): a record missing for a request taken before then
                                     was lost with a restart, not ended
    pdd:kv:<id>                set   chained hashes of the KV blocks instance <id> caches
    pdd:kv:<id>:seq            int   count of index events applied (one per stored/removed batch)
    pdd:kv:<id>:update         int   the last index update applied (its number): registrars apply
                                     an instance's updates in order, whichever of them gets each
    pdd:kv:<id>:resync         str   set when an update was missed: the next heartbeat asks for all
    pdd:plan:<id>              str   a request's plan (base64 msgpack), or "planning <scheduler>"
                                     while one plans it: every scheduler answers a resubmission alike
    pdd:process:<kind>:<name>  hash  a gateway's or scheduler's presence (pid, dc, url), renewed
                                     each heartbeat: `pdd status` lists them
An instance clears its own `pdd:kv` keys when it starts; they expire with its heartbeat.
A dead instance stops heartbeating, its key expires, and nothing is routed to it afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Collection

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.config import ClusterConfig
from shared.messages import ControlProcess, IndexEvent, IndexUpdate, InstanceInfo
from shared.security import Secrets

log = logging.getLogger(__name__)
INSTANCE = "pdd:instance:"
REQUEST = "pdd:request:"
EPOCH = "pdd:epoch"
KV = "pdd:kv:"
PLAN = "pdd:plan:"
INSTANCES = "pdd:instances"
FIRST = "pdd:first:"  # a chain's first block -> the instances holding it (`IndexEvent.first`)
PLANNING = "planning "  # a plan key's value while a scheduler plans it, before its name
ADOPTED = "pdd:adopted:"
INDEX_ORDER_WAIT_S = 0.2  # an index update that overtook its predecessor waits this long for it
PROCESS = "pdd:process:"
REPLICA_WAIT_MS = 200  # how long a record waits for a replica's copy (a dead replica costs this, not a failure)


_DELETE_IF_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Drop from the set of instance ids (KEYS[1]) those whose row (prefix ARGV[1]) is still gone: a
# heartbeat may have written one again since it was read.
_DROP_EXPIRED_LUA = """
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 then redis.call('SREM', KEYS[1], ARGV[i]) end
end
return 0
"""

# The instances holding the first of the hashes in ARGV[3] (space-separated, in order), from the
# first blocks' index (ARGV[2] .. hash: their ids), and how many of the hashes each holds before
# its first miss (its block set: ARGV[1] .. id); "id:n ..." for those holding any. A fleet's
# instances mostly miss a prompt's first block: a lookup asks only the few that hold it, not
# each instance (200 SISMEMBERs were most of Redis's time per plan). Each holder's count starts
# from its own set, so a stale entry (its set expired) counts nothing; the rest is asked in
# chunks that double (SMISMEMBER, Redis 6.2), not one call per block nor 256 members for a run of
# a few. The sets are named in ARGV, not KEYS: PDD's Redis is one primary (with replicas), and a
# Redis Cluster could not run this script anyway, since the instances' sets share no hash slot.
_LEADING_HITS = """
local function leading_hits(prefix, first_prefix, hashes_arg)
  local hashes = {}
  for h in string.gmatch(hashes_arg, '%S+') do hashes[#hashes + 1] = h end
  if #hashes == 0 then return '' end
  local out = {}
  for _, id in ipairs(redis.call('SMEMBERS', first_prefix .. hashes[1])) do
    local key = prefix .. id
    if redis.call('SISMEMBER', key, hashes[1]) == 1 then
      local n, from, chunk = 1, 2, 8
      while from <= #hashes do
        local to = math.min(from + chunk - 1, #hashes)
        local held = redis.call('SMISMEMBER', key, unpack(hashes, from, to))
        local missed = false
        for i = 1, #held do
          if held[i] == 0 then missed = true break end
          n = n + 1
        end
        if missed then break end
        from, chunk = to + 1, math.min(2 * chunk, 256)
      end
      out[#out + 1] = id .. ':' .. n
    end
  end
  return table.concat(out, ' ')
end
"""
_LEADING_HITS_LUA = _LEADING_HITS + "return leading_hits(ARGV[1], ARGV[2], ARGV[3])"

# A plan's claim (KEYS[1]: SET NX of ARGV[1] for ARGV[2] ms) and, when it is won, the prefix
# lookup above (ARGV[3..5]) in the same round trip; {1, hits} when claimed, else {0, what the key
# holds}: the two calls every plan starts with, for one round trip's Python instead of two.
_CLAIM_AND_LOOK_LUA = (
    _LEADING_HITS
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, leading_hits(ARGV[3], ARGV[4], ARGV[5])}
end
return {0, redis.call('GET', KEYS[1])}
"""
)

# A request's record (KEYS[1]): ARGV[1] its TTL (s), then its fields and values; one transaction.
_RECORD_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 0
"""

# What a heartbeat changes, in one round trip (the registrar handles every instance's, each second):
# KEYS pdd:instances, pdd:instance:<id>, pdd:epoch, pdd:kv:<id>, its :seq, :update, :resync and
# :firsts;
# ARGV the id, the row's TTL (ms; 0: the row is left as it is), now (the epoch if none is set),
# the index's TTL (ms; 0: the index is left as it is), then the row's fields and values.
# Returns 1 when the instance must send its whole index (`Registry.index_state`), else 0.
_HEARD_LUA = """
if ARGV[2] ~= '0' then
  redis.call('SADD', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[2], unpack(ARGV, 5))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('SET', KEYS[3], ARGV[3], 'NX')
end
if ARGV[4] == '0' then return 0 end
redis.call('PEXPIRE', KEYS[4], ARGV[4])
local seq_alive = redis.call('PEXPIRE', KEYS[5], ARGV[4])
local numbered = redis.call('PEXPIRE', KEYS[6], ARGV[4])
local missed = redis.call('GETDEL', KEYS[7])
redis.call('PEXPIRE', KEYS[8], ARGV[4])
if seq_alive == 0 or numbered == 0 or missed then return 1 end
return 0
"""


def connect(
    url: str, password: str | None = None, sentinels: str = "", master: str = "pdd", username: str | None = None
) -> aioredis.Redis:
    """A client that rides out a Redis restart: a command on a dropped connection is retried on
    a fresh one instead of failing. `username`, `password`: the process's login (pdd certs),
    unless the URL has one.
    With `sentinels` ("host:port,..."), the client asks them where primary `master` is, on every
    new connection: after a failover the retried command reaches the promoted replica."""
    options = dict(
        decode_responses=True,
        socket_timeout=5,
        socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3 if not sentinels else 8),  # a failover: ~1-3 s
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionError, ReadOnlyError],
        health_check_interval=5,
        # a burst of reports (200 instances' heartbeats) runs that many handlers at once: redis-py's
        # default pool of 100 refused the rest ("Too many connections"); the server allows 10,000
        max_connections=1024,
    )
    if not sentinels:
        return aioredis.Redis.from_url(url, username=username, password=password, **options)
    where = [(h, int(p)) for h, p in (hp.rsplit(":", 1) for hp in sentinels.split(",") if hp)]
    login = {"username": username, "password": password}
    watchers = Sentinel(where, sentinel_kwargs=login | {"socket_timeout": 1.0}, **login)
    return watchers.master_for(master, connection_class=_PrimaryConnection, **options)


class _PrimaryConnection(SentinelManagedConnection):
    """A connection to the primary that asks the Sentinels where it is on every reconnect.
    redis-py's own reconnects a dropped socket to the address it had (its commands reconnect
    through `connect_check_health`, not the `connect` that asks the Sentinels): after a failover
    every retry went to the dead primary until they ran out."""

    async def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True):
        if not self.is_connected and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health=check_health, retry_socket_connect=False)


class Registry:
    def __init__(self, client: aioredis.Redis, ttl_s: float, replicas: int = 0) -> None:
        self.r = client
        self.ttl_ms = int(ttl_s * 1000)
        self.replicas = replicas  # a request's record waits for one replica's copy (a failover keeps it)
        self._prefix_script = None
        self._claim_script = None
        self._release_script = None
        self._drop_script = None
        self._heard_script = None
        self._record_script = None

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Registry:
        """The cluster's registry, as its gateway and schedulers reach it (through its Sentinels
        when it is replicated)."""
        secrets = Secrets.of(cfg)
        login = (secrets.redis_password, secrets.redis_user) if secrets else (None, None)
        client = connect(cfg.redis_url, login[0], cfg.redis_sentinels, cfg.control_plane.redis_master, login[1])
        return cls(client, cfg.heartbeat_ttl_s, replicas=cfg.control_plane.redis_replicas)

    async def heartbeat(self, info: InstanceInfo, sampled_at: float | None = None, ttl_s: float = 0.0) -> None:
        """Publish `info` for `ttl_s` (default: the registry's). `sampled_at`: when its load
        figures were read (default now); the scheduler counts its dispatches after that moment
        on top of them."""
        await self._heard(info.id, info, sampled_at, ttl_s, index=False)

    async def heard(self, info: InstanceInfo, sampled_at: float | None = None, ttl_s: float = 0.0) -> bool:
        """`heartbeat` and `index_state` in one round trip: what the registrar does with each
        heartbeat it hears (200 a second at fleet size)."""
        return await self._heard(info.id, info, sampled_at, ttl_s, index=True)

    async def _heard(
        self, instance_id: str, info: InstanceInfo | None, sampled_at: float | None, ttl_s: float, index: bool
    ) -> bool:
        """The row of `info` (None: left as it is) and, with `index`, the index's expiry refreshed
        (one Lua call: a row alone is one transaction, as before)."""
        row: list[str] = []
        row_ttl_ms = 0
        if info is not None:
            info.updated_at = sampled_at or time.time()
            row = [str(v) for name in _INFO_FIELDS for v in (name, getattr(info, name))]  # no asdict deep copy
            row_ttl_ms = int(ttl_s * 1000) or self.ttl_ms
        if self._heard_script is None:
            self._heard_script = self.r.register_script(_HEARD_LUA)
        key = KV + instance_id
        keys = [INSTANCES, INSTANCE + instance_id, EPOCH, key]
        keys += [key + ":seq", key + ":update", key + ":resync", key + ":firsts"]
        index_ttl_ms = self.ttl_ms * 10 if index else 0
        args = [instance_id, row_ttl_ms, repr(time.time()), index_ttl_ms, *row]
        return bool(await self._heard_script(keys=keys, args=args))

    async def announce(
        self, kind: str, name: str, dc: str, every_s: float, figures: Callable[[], dict[str, str]] = dict, **fields: str
    ) -> None:
        """Say this control-plane process is alive, every `every_s` until cancelled (a missed
        write is retried at the next; its key expires after three), with its `figures()` then."""
        key = f"{PROCESS}{kind}:{name}"
        row = {"kind": kind, "name": name, "dc": dc, "pid": str(os.getpid()), "since": repr(time.time()), **fields}
        while True:
            try:
                async with self.r.pipeline(transaction=True) as pipe:
                    pipe.hset(key, mapping=row | figures())
                    pipe.pexpire(key, int(3 * every_s * 1000))
                    await pipe.execute()
            except Exception as e:  # Redis failing over: the next beat writes it again
                log.debug("presence of %s not written: %s", name, e)
            await asyncio.sleep(every_s)

    async def processes(self) -> list[ControlProcess]:
        """The gateways and schedulers alive now (their presence rows), by kind and name."""
        keys = [k async for k in self.r.scan_iter(match=PROCESS + "*", count=1000)]
        async with self.r.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hgetall(k)
            rows = await pipe.execute()
        names = {f.name: f for f in dataclasses.fields(ControlProcess)}
        parsed = [
            ControlProcess.from_dict({k: int(v) if names[k].type == "int" else v for k, v in r.items() if k in names})
            for r in rows
            if r
        ]
        return sorted(parsed, key=lambda p: (p.kind, p.name))

    async def remove(self, instance_id: str) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(INSTANCE + instance_id)
            pipe.srem(INSTANCES, instance_id)
            await pipe.execute()

    async def alive(self, role: str | None = None) -> list[InstanceInfo]:
        """Every instance whose row has not expired (the ids from `pdd:instances`: a SCAN walked
        every key, the requests' plans too; an id whose row expired is dropped from it here)."""
        ids = sorted(await self.r.smembers(INSTANCES))
        if not ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for iid in ids:
                pipe.hgetall(INSTANCE + iid)
            rows = await pipe.execute()
        if gone := [iid for iid, row in zip(ids, rows) if not row]:
            if self._drop_script is None:
                self._drop_script = self.r.register_script(_DROP_EXPIRED_LUA)
            await self._drop_script(keys=[INSTANCES], args=[INSTANCE, *gone])
        infos = [_info_from_hash(row) for row in rows if row]
        return sorted((i for i in infos if role is None or i.role == role), key=lambda i: i.id)

    async def set_request(self, request_id: str, fields: dict[str, str], ttl_s: float) -> None:
        """Record a request. With replicas, returns once one of them has it too: a holder drops a
        request whose record is gone, so a failover must not lose a record written just before."""
        if self._record_script is None:
            self._record_script = self.r.register_script(_RECORD_LUA)
        args = [int(ttl_s), *(v for kv in fields.items() for v in kv)]
        await self._record_script(keys=[REQUEST + request_id], args=args)  # one reply, not MULTI's four
        if self.replicas:
            await self.r.execute_command("WAIT", 1, REPLICA_WAIT_MS)

    async def delete_request(self, request_id: str) -> None:
        await self.r.delete(REQUEST + request_id)

    async def renew_requests(self, request_ids: list[str], ttl_s: float) -> tuple[list[str], float]:
        """Renew the records of `request_ids` for `ttl_s` (a stream may run longer than its first
        TTL); returns those no longer recorded, and when this Redis's data began (`pdd:epoch`,
        set now if it is new). One round trip."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.set(EPOCH, repr(time.time()), nx=True)
            pipe.get(EPOCH)
            for rid in request_ids:
                pipe.expire(REQUEST + rid, int(ttl_s))
            _, epoch, *renewed = await pipe.execute()
        return [rid for rid, ok in zip(request_ids, renewed) if not ok], float(epoch)

    async def epoch_age(self) -> float | None:
        """Seconds since this Redis's data began (None: not set since it started empty)."""
        epoch = await self.r.get(EPOCH)
        return None if epoch is None else time.time() - float(epoch)

    async def request_ids(self) -> list[str]:
        return [k[len(REQUEST) :] async for k in self.r.scan_iter(match=REQUEST + "*", count=1000)]

    # -- the prefix-cache index ---------------------------------------------------------------

    async def apply_index_update(self, instance_id: str, update: IndexUpdate) -> bool:
        """Apply an instance's numbered `IndexUpdate` in order, in one transaction, whichever
        registrar got it: one that comes before its predecessor was applied waits a moment for it
        (another registrar has it). False when the predecessor never came (a gap: the events are
        applied anyway and the instance is marked to send its whole index)."""
        key = KV + instance_id
        full = bool(update.events) and update.events[0].kind == "cleared"
        deadline = time.monotonic() + INDEX_ORDER_WAIT_S
        async with self.r.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key + ":update")
                    last = await pipe.get(key + ":update")
                    in_order = full or (last is not None and int(last) == update.seq - 1)
                    behind = last is None or int(last) < update.seq - 1  # its predecessor may be on its way
                    if not in_order and behind and time.monotonic() < deadline:
                        await pipe.unwatch()
                        await asyncio.sleep(0.002)
                        continue
                    pipe.multi()
                    _queue_events(pipe, instance_id, update.events)
                    pipe.set(key + ":update", update.seq)
                    if not in_order:
                        pipe.set(key + ":resync", 1)
                    for k in (key, key + ":seq", key + ":update", key + ":resync", key + ":firsts"):
                        pipe.pexpire(k, self.ttl_ms * 10)
                    await pipe.execute()
                    return in_order
                except WatchError:  # another registrar applied one meanwhile: look again
                    continue

    async def apply_kv_events(self, instance_id: str, events: list[IndexEvent]) -> None:
        """Apply `IndexEvent`s in one transaction, unnumbered (tools and tests filling an index)."""
        key = KV + instance_id
        async with self.r.pipeline(transaction=True) as pipe:
            _queue_events(pipe, instance_id, events)
            for k in (key, key + ":seq", key + ":firsts"):
                pipe.pexpire(k, self.ttl_ms * 10)
            await pipe.execute()

    async def index_state(self, instance_id: str) -> bool:
        """Refresh the index's expiry; True when the instance must send it whole: Redis lost it
        (restarted empty), an update went missing, or no update of its was ever applied."""
        return await self._heard(instance_id, None, None, 0.0, index=True)

    async def forget_index_order(self, instance_id: str) -> None:
        """It left: its next update after a return starts a new count (and a whole index)."""
        await self.r.delete(KV + instance_id + ":update", KV + instance_id + ":resync")

    async def adopt(self, request_id: str, ttl_s: float) -> bool:
        """True once per request id within `ttl_s`, whichever registrar asks: a record lost with a
        Redis restart is written again once, not again after the request ended."""
        return bool(await self.r.set(ADOPTED + request_id, 1, nx=True, ex=max(1, int(ttl_s))))

    # -- plans shared by the schedulers ------------------------------------------------------
    async def claim_plan(
        self, request_id: str, scheduler: str, ttl_s: float, instance_ids: list[str], hashes: list[str]
    ) -> tuple[str | None, dict[str, int]]:
        """(None, `prefix_blocks(instance_ids, hashes)`) when `scheduler` now plans the request,
        looked up in the claim's round trip; else (what the key holds, {}): a plan (base64), or
        "planning <name>" while another plans it."""
        if self._claim_script is None:
            self._claim_script = self.r.register_script(_CLAIM_AND_LOOK_LUA)
        args = [f"{PLANNING}{scheduler}", int(ttl_s * 1000), KV, FIRST, " ".join(hashes)]
        claimed, held = await self._claim_script(keys=[PLAN + request_id], args=args)
        return (None, _hits(held, instance_ids)) if claimed else (held, {})

    async def save_plans(self, encoded: dict[str, str], ttl_s: float) -> None:
        """Each request's plan (base64) in place of its claim: one round trip for all."""
        async with self.r.pipeline(transaction=False) as pipe:
            for request_id, plan in encoded.items():
                pipe.set(PLAN + request_id, plan, px=int(ttl_s * 1000))
            await pipe.execute()

    async def release_claim(self, request_id: str, held: str) -> bool:
        """Remove the claim `held` (a dead scheduler's), unless it changed meanwhile."""
        if self._release_script is None:
            self._release_script = self.r.register_script(_DELETE_IF_LUA)
        return bool(await self._release_script(keys=[PLAN + request_id], args=[held]))

    async def process_alive(self, kind: str, name: str) -> bool:
        return bool(await self.r.exists(f"{PROCESS}{kind}:{name}"))

    async def prefix_blocks(self, instance_ids: list[str], hashes: list[str]) -> dict[str, int]:
        """How many leading blocks of `hashes` each instance holds, for those holding any (an
        instance absent holds none): one round trip for all, counted inside Redis."""
        if not hashes or not instance_ids:
            return {}
        if self._prefix_script is None:
            self._prefix_script = self.r.register_script(_LEADING_HITS_LUA)
        held = await self._prefix_script(keys=[], args=[KV, FIRST, " ".join(hashes)])
        return _hits(held, instance_ids)


def _hits(held: str, instance_ids: Collection[str]) -> dict[str, int]:
    """The lookup's "id:n ..." as {id: n}, for the instances asked about (the index may name one
    that is gone); instance ids have no spaces nor colons (config.INSTANCE_ID)."""
    if not held:
        return {}
    asked = set(instance_ids)
    pairs = (pair.rpartition(":") for pair in held.split())
    return {iid: int(n) for iid, _, n in pairs if iid in asked}


# An instance (ARGV[2]) lets go of the first blocks it listed (KEYS[1]) in their index (ARGV[1] ..
# hash), and of the list: its index was cleared.
_FORGET_FIRSTS_LUA = """
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do redis.call('SREM', ARGV[1] .. h, ARGV[2]) end
return redis.call('DEL', KEYS[1])
"""


def _queue_events(pipe, instance_id: str, events: list[IndexEvent]) -> None:
    """Stored / removed / cleared events, in order, onto `pipe`; each counted in `<key>:seq`. A
    chain's first blocks (`first`) are also listed in `<key>:firsts` and indexed by block (FIRST),
    where the lookup finds their holders."""
    key = KV + instance_id
    for ev in events:
        if ev.kind == "stored" and ev.hashes:
            pipe.sadd(key, *ev.hashes)
            if ev.first:
                pipe.sadd(key + ":firsts", *ev.hashes)
                for h in ev.hashes:
                    pipe.sadd(FIRST + h, instance_id)
        elif ev.kind == "removed" and ev.hashes:
            pipe.srem(key, *ev.hashes)
            if ev.first:
                pipe.srem(key + ":firsts", *ev.hashes)
                for h in ev.hashes:
                    pipe.srem(FIRST + h, instance_id)
        elif ev.kind == "cleared":
            pipe.eval(_FORGET_FIRSTS_LUA, 1, key + ":firsts", FIRST, instance_id)
            pipe.delete(key)
        pipe.incr(key + ":seq")


_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(InstanceInfo))


def _info_from_hash(raw: dict[str, str]) -> InstanceInfo:
    """The hash's strings as their fields' numbers, then checked as a message is (the role a Role)."""
    parse = {"float": float, "int": int}
    kwargs = {f.name: parse.get(f.type, str)(raw[f.name]) for f in dataclasses.fields(InstanceInfo) if f.name in raw}
    return InstanceInfo.from_dict(kwargs)
