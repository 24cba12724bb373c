"""Registrar: writes what instances report over NATS into Redis (datacenter A).

Redis stays inside the scheduler's datacenter: it has no TLS, and nothing may cross the WAN in
the clear. Instances in either datacenter report over NATS (whose link between datacenters is
encrypted and authenticated), and this component, in the scheduler's process, writes:

1. `Heartbeat`s (request-reply) -> `pdd:instance:<id>` with a TTL, refreshing the instance's
   prefix index. The reply asks for the whole index when Redis has lost it, when an update
   went missing, or when this registrar has not heard from the instance before; and it names
   the requests the instance still holds that are no longer in flight (`pdd:request:<id>`
   gone: finished, aborted, or moved elsewhere while the line was down and the abort lost),
   so the instance drops them: nothing is held for a request nobody waits for.
2. `IndexUpdate` (publish, numbered per instance) -> the instance's block set, in order. A gap
   in the numbers marks the instance for a full resync on its next heartbeat.
3. `Leave` -> the instance is forgotten at once instead of when its heartbeat expires.
"""

from __future__ import annotations

import logging

from shared import subjects
from shared.bus import Bus
from shared.messages import Heartbeat, HeartbeatReply, IndexUpdate, Leave
from shared.registry import Registry

log = logging.getLogger(__name__)


class Registrar:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._seq: dict[str, int] = {}  # instance -> last index update applied
        self._resync: set[str] = set()  # instances whose index must be sent whole

    async def serve(self, bus: Bus) -> None:
        await bus.serve(subjects.HEARTBEAT, Heartbeat, self.on_heartbeat)
        await bus.serve(subjects.INDEX, IndexUpdate, self.on_index)
        await bus.serve(subjects.LEAVE, Leave, self.on_leave)

    async def on_heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        info = beat.info
        await self.registry.heartbeat(info, info.updated_at or None)
        present = await self.registry.kv_present(info.id)
        resync = info.id not in self._seq or info.id in self._resync or not present
        self._resync.discard(info.id)
        forget = await self.registry.gone_requests(beat.holding) if beat.holding else []
        return HeartbeatReply(resync_index=resync, forget=forget)

    async def on_index(self, update: IndexUpdate) -> None:
        iid = update.instance_id
        full = bool(update.events) and update.events[0].kind == "cleared"
        last = self._seq.get(iid)
        if not full and (last is None or update.seq != last + 1):
            log.info("registrar: index update %d of %s after %s: asking for the whole index", update.seq, iid, last)
            self._resync.add(iid)
        await self.registry.apply_kv_events(iid, update.events)
        self._seq[iid] = update.seq

    async def on_leave(self, msg: Leave) -> None:
        self._seq.pop(msg.instance_id, None)
        self._resync.discard(msg.instance_id)
        await self.registry.remove(msg.instance_id)
