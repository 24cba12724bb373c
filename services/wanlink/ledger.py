"""Who sent how much over the link: per-request byte counts, kept here and mirrored to Redis.

Redis keys (each expires TTL_S after its last write):

    pdd:wan:{name}:bytes        hash    request_id -> bytes forwarded A->B (after the ROUTE frame)
    pdd:wan:{name}:total_bytes  string  bytes forwarded A->B for all requests, over the key's life
    pdd:wan:{name}:state        hash    bandwidth_mbps, delay_ms, jitter_ms, connections, stalled,
                                        total_bytes (this run of the link)

A chunk is counted (in memory and in Redis) BEFORE it is written upstream, so by the time the
receiver has the last byte of a request, its count is complete. A connection cut between the
two may leave Redis one chunk ahead of what arrived.

A Redis outage never stops the link: the write is skipped and logged once per outage.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

TTL_S = 3600
MAX_TRACKED = 100_000  # request ids remembered in memory (oldest forgotten first)


def bytes_key(name: str) -> str:
    return f"pdd:wan:{name}:bytes"


def total_key(name: str) -> str:
    return f"pdd:wan:{name}:total_bytes"


def state_key(name: str) -> str:
    return f"pdd:wan:{name}:state"


class ByteLedger:
    """The one owner of the link's byte counts; `redis` may be None (in-memory only)."""

    def __init__(self, name: str, redis: Redis | None) -> None:
        self.name = name
        self.redis = redis
        self.total = 0
        self._by_request: OrderedDict[str, int] = OrderedDict()
        self._redis_ok = True

    def forwarded(self, request_id: str) -> int:
        return self._by_request.get(request_id, 0)

    async def add(self, request_id: str, nbytes: int) -> None:
        """Count `nbytes` about to be written upstream for `request_id`; Redis first."""
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(bytes_key(self.name), request_id, nbytes)
            pipe.expire(bytes_key(self.name), TTL_S)
            pipe.incrby(total_key(self.name), nbytes)
            pipe.expire(total_key(self.name), TTL_S)
            pipe.hincrby(state_key(self.name), "total_bytes", nbytes)
            await self._run(pipe)
        self.total += nbytes
        self._by_request[request_id] = self._by_request.pop(request_id, 0) + nbytes
        if len(self._by_request) > MAX_TRACKED:
            self._by_request.popitem(last=False)

    async def publish_state(self, fields: dict[str, Any], reset_total: bool = False) -> None:
        """Write the link's settings (and, at start, total_bytes = 0) to the state hash."""
        if self.redis is None:
            return
        mapping = {k: str(v) for k, v in fields.items()}
        if reset_total:
            mapping["total_bytes"] = "0"
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(state_key(self.name), mapping=mapping)
        pipe.expire(state_key(self.name), TTL_S)
        await self._run(pipe)

    async def _run(self, pipe: Any) -> None:
        try:
            await pipe.execute()
        except (RedisError, OSError) as e:
            if self._redis_ok:
                log.warning("wan %s: Redis write failed, byte counts there are incomplete: %s", self.name, e)
            self._redis_ok = False
            return
        if not self._redis_ok:
            log.info("wan %s: Redis writes work again", self.name)
        self._redis_ok = True
