"""Redis: the instance registry (heartbeats with a TTL), load figures, request state, prefix index.

Redis lives in datacenter A. Instances never write it: they report over NATS (heartbeats,
prefix-cache events) and the scheduler's registrar (services/scheduler/registrar.py) writes
them here; the scheduler and the gateway read them.

Keys
    pdd:instance:<id>          hash  InstanceInfo fields; expires unless refreshed by heartbeats
    pdd:request:<id>           hash  plan of an in-flight request; deleted when it ends, renewed
                                     while an instance reports holding it
    pdd:epoch                  str   when this Redis's data began (wall clock of the registrar that
                                     set it): a record missing for a request taken before then
                                     was lost with a restart, not ended
    pdd:kv:<id>                set   chained hashes of the KV blocks instance <id> caches
    pdd:kv:<id>:seq            int   count of index events applied (one per stored/removed batch)
An instance clears its own `pdd:kv` keys when it starts; they expire with its heartbeat.
A dead instance stops heartbeating, its key expires, and nothing is routed to it afterwards.
"""

from __future__ import annotations

import dataclasses
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.messages import IndexEvent, InstanceInfo

INSTANCE = "pdd:instance:"
REQUEST = "pdd:request:"
EPOCH = "pdd:epoch"
KV = "pdd:kv:"


# For each key (an instance's block set): how many of ARGV, in order, it holds before the first miss.
_LEADING_HITS_LUA = """
local out = {}
for k = 1, #KEYS do
  local n = 0
  for i = 1, #ARGV do
    if redis.call('SISMEMBER', KEYS[k], ARGV[i]) == 0 then break end
    n = i
  end
  out[k] = n
end
return out
"""


def connect(url: str, password: str | None = None) -> aioredis.Redis:
    """A client that rides out a Redis restart: a command on a dropped connection is retried on
    a fresh one instead of failing. `password`: the cluster's (pdd certs), unless the URL has one."""
    return aioredis.Redis.from_url(
        url,
        password=password,
        decode_responses=True,
        socket_timeout=5,
        socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, ConnectionError],
        health_check_interval=5,
    )


class Registry:
    def __init__(self, client: aioredis.Redis, ttl_s: float) -> None:
        self.r = client
        self.ttl_ms = int(ttl_s * 1000)
        self._prefix_script = None

    async def heartbeat(self, info: InstanceInfo, sampled_at: float | None = None, ttl_s: float = 0.0) -> None:
        """Publish `info` for `ttl_s` (default: the registry's). `sampled_at`: when its load
        figures were read (default now); the scheduler counts its dispatches after that moment
        on top of them."""
        info.updated_at = sampled_at or time.time()
        key = INSTANCE + info.id
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={k: str(v) for k, v in dataclasses.asdict(info).items()})
            pipe.pexpire(key, int(ttl_s * 1000) or self.ttl_ms)
            pipe.set(EPOCH, repr(time.time()), nx=True)  # a Redis that (re)started empty begins its epoch
            await pipe.execute()

    async def remove(self, instance_id: str) -> None:
        await self.r.delete(INSTANCE + instance_id)

    async def alive(self, role: str | None = None) -> list[InstanceInfo]:
        keys = [k async for k in self.r.scan_iter(match=INSTANCE + "*", count=1000)]
        if not keys:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hgetall(k)
            rows = await pipe.execute()
        infos = [_info_from_hash(row) for row in rows if row]
        return sorted((i for i in infos if role is None or i.role == role), key=lambda i: i.id)

    async def set_request(self, request_id: str, fields: dict[str, str], ttl_s: float) -> None:
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(REQUEST + request_id, mapping=fields)
            pipe.expire(REQUEST + request_id, int(ttl_s))
            await pipe.execute()

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
    async def clear_kv(self, instance_id: str) -> None:
        await self.r.delete(KV + instance_id, KV + instance_id + ":seq")

    async def apply_kv_events(self, instance_id: str, events: list[IndexEvent]) -> None:
        """Apply `IndexEvent`s (stored / removed / cleared) in order, in one transaction."""
        key = KV + instance_id
        async with self.r.pipeline(transaction=True) as pipe:
            for ev in events:
                if ev.kind == "stored" and ev.hashes:
                    pipe.sadd(key, *ev.hashes)
                elif ev.kind == "removed" and ev.hashes:
                    pipe.srem(key, *ev.hashes)
                elif ev.kind == "cleared":
                    pipe.delete(key)
                pipe.incr(key + ":seq")
            pipe.pexpire(key, self.ttl_ms * 10)
            pipe.pexpire(key + ":seq", self.ttl_ms * 10)
            await pipe.execute()

    async def kv_present(self, instance_id: str) -> bool:
        """Refresh the index's expiry; False when Redis has lost it (e.g. restarted empty)."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.pexpire(KV + instance_id, self.ttl_ms * 10)
            pipe.pexpire(KV + instance_id + ":seq", self.ttl_ms * 10)
            _, seq_alive = await pipe.execute()
        return bool(seq_alive)

    async def prefix_blocks(self, instance_ids: list[str], hashes: list[str]) -> dict[str, int]:
        """How many leading blocks of `hashes` each instance holds: one round trip for all,
        counted inside Redis so only one integer per instance comes back."""
        if not hashes or not instance_ids:
            return {i: 0 for i in instance_ids}
        if self._prefix_script is None:
            self._prefix_script = self.r.register_script(_LEADING_HITS_LUA)
        counts = await self._prefix_script(keys=[KV + i for i in instance_ids], args=hashes)
        return {iid: int(n) for iid, n in zip(instance_ids, counts)}


def _info_from_hash(raw: dict[str, str]) -> InstanceInfo:
    """The hash's strings as their fields' numbers, then checked as a message is (the role a Role)."""
    parse = {"float": float, "int": int}
    kwargs = {f.name: parse.get(f.type, str)(raw[f.name]) for f in dataclasses.fields(InstanceInfo) if f.name in raw}
    return InstanceInfo.from_dict(kwargs)
