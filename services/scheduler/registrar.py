"""Registrar: writes what instances report over NATS into Redis (datacenter A).

Redis stays inside the scheduler's datacenter: it has no TLS, and nothing may cross the WAN in
the clear. Instances in either datacenter report over NATS (whose link between datacenters is
encrypted and authenticated), and this component, in each scheduler's process, writes what it
gets. The registrars of several schedulers form one NATS queue group: each report is handled
once, by any of them, and whatever must be remembered between reports lives in Redis (an
instance's last index update, a missed one, a request recorded again), so a registrar may die
or start at any time:

1. `Heartbeat`s (request-reply) -> `pdd:instance:<id>` with a TTL, refreshing the instance's
   prefix index. The reply asks for the whole index when Redis has lost it, when an update
   went missing, or when this registrar has not heard from the instance before; and it names
   the requests the instance still holds that are no longer in flight (`pdd:request:<id>`
   gone: finished, aborted, or moved elsewhere while the line was down and the abort lost),
   so the instance drops them: nothing is held for a request nobody waits for. The records of
   requests still held are renewed (a long stream outlives its first TTL); a record Redis lost
   in a restart (the request was taken before `pdd:epoch`) is written again, not forgotten.
   Liveness is the registrar's clock: the TTL runs from when it heard the instance, longer for
   another site's instances (the line's delay, one lost heartbeat); an instance whose last
   heartbeat replies did not reach it (the line is down towards it) is not refreshed.
2. `IndexUpdate` (publish, numbered per instance) -> the instance's block set, in order (an
   update that overtook its predecessor on another registrar waits for it). A gap in the
   numbers marks the instance for a full resync on its next heartbeat.
3. `Leave` -> the instance is forgotten at once instead of when its heartbeat expires.

Every report is vetted first (`Roster.vet`): it must come from the instance it is about (the
subject names the sender, and the NATS servers let each instance publish on its own subjects
only), that instance must be one the cluster config lists, with its role and site and (when the
config fixes it) its KV port, and its figures must be in range. A report that fails is dropped
and logged: a compromised instance cannot register, re-address or remove another, nor invent
instances that would draw requests or make every plan 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig, InstanceConfig
from shared.messages import Heartbeat, HeartbeatReply, IndexUpdate, InstanceInfo, Leave
from shared.pipelines import Role
from shared.registry import Registry

log = logging.getLogger(__name__)


MISSED_REPLIES = 2  # heartbeat replies in a row an instance may miss before it is not refreshed
QUEUE = "registrars"  # the NATS queue group of every scheduler's registrar
_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(InstanceInfo))  # vetted on every heartbeat, twice


@dataclass(frozen=True)
class Heard:
    sampled_at: float  # when its figures were read, on the hearer's clock
    ttl_s: float  # how long it lives from now without another heartbeat


@dataclass(frozen=True)
class Liveness:
    """How long a heartbeat keeps an instance alive, by the hearer's clock (never the instance's:
    two sites' clocks are not compared): the TTL, longer for another site's instances (the line's
    delay, one lost heartbeat); none for an instance whose last replies did not reach it (the
    line is down towards it: tasks would not reach it either). The registrar writes it to Redis,
    and each scheduler's live view (services/scheduler/live_view.py) keeps it in memory."""

    ttl_s: float
    control_dc: str = "A"
    line_delay_s: float = 0.0  # one way
    heartbeat_s: float = 1.0

    def heard(self, beat: Heartbeat, now: float) -> Heard | None:
        if beat.missed_replies >= MISSED_REPLIES:
            return None
        remote = beat.info.dc != self.control_dc
        delay = self.line_delay_s if remote else 0.0  # it sampled its figures about this long ago
        return Heard(now - delay, self.ttl_s + (self.heartbeat_s + 2 * delay if remote else 0.0))


class Refused(Exception):
    """A report the registrar does not take: why, for the log."""


@dataclass(frozen=True)
class Roster:
    """The instances the cluster config lists; None: any (a bench or test without a config)."""

    instances: dict[str, InstanceConfig] | None = None
    endpoints: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)  # where prefill dials each

    @classmethod
    def of(cls, cfg: ClusterConfig) -> Roster:
        decoders = [i for i in cfg.instances if i.role != Role.PREFILL]  # prefill listens for no KV
        return cls({i.id: i for i in cfg.instances}, {i.id: cfg.kv_endpoint(i) for i in decoders})

    def vet(self, reporter: str, claimed: str, info: InstanceInfo | None = None) -> None:
        """Raise Refused unless `reporter` (the subject's sender) sends about itself (`claimed`),
        is listed, and `info` (a heartbeat's) matches its config, with every figure in range."""
        if claimed != reporter:
            raise Refused(f"{reporter} reported as {claimed!r}")
        if self.instances is None:
            return
        if (inst := self.instances.get(reporter)) is None:
            raise Refused(f"{reporter!r} is not an instance of the cluster config")
        if info is None:
            return
        if (info.role, info.dc) != (inst.role, inst.dc):
            raise Refused(f"{reporter} reported role {info.role} in {info.dc}; it is {inst.role} in {inst.dc}")
        host, port = self.endpoints.get(reporter, ("", 0))  # port 0: any, picked when it starts
        if (host and info.kv_host != host) or (port and info.kv_port != port):
            raise Refused(f"{reporter} reported its KV at {info.kv_host}:{info.kv_port}; the config says {host}:{port}")
        for name in _INFO_FIELDS:
            value = getattr(info, name)
            if isinstance(value, int | float) and not (math.isfinite(value) and 0 <= value < 2**53):
                raise Refused(f"{reporter} reported {name} = {value!r}")


class Registrar:
    def __init__(
        self,
        registry: Registry,
        request_ttl_s: float = 600.0,
        control_dc: str = "A",
        line_delay_s: float = 0.0,
        heartbeat_s: float = 1.0,
        roster: Roster | None = None,
    ) -> None:
        self.registry = registry
        self.roster = roster or Roster()
        self.request_ttl_s = request_ttl_s
        self.control_dc = control_dc  # the registrar's site: others' heartbeats cross the line
        self.line_delay_s = line_delay_s  # one way
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(registry.ttl_ms / 1000, control_dc, line_delay_s, heartbeat_s)
        self._index_lock: dict[str, asyncio.Lock] = {}  # instance -> its updates here, in arrival order

    async def serve(self, bus: Bus) -> None:
        await bus.serve(subjects.HEARTBEATS, Heartbeat, self.on_heartbeat, queue=QUEUE, by_reporter=True)
        await bus.serve(subjects.INDEXES, IndexUpdate, self.on_index, queue=QUEUE, by_reporter=True)
        await bus.serve(subjects.LEAVES, Leave, self.on_leave, queue=QUEUE, by_reporter=True)

    def _refuses(self, what: str, reporter: str | None, claimed: str, info: InstanceInfo | None = None) -> bool:
        """True (logged) when the report fails `Roster.vet`. `reporter` None: a call in this
        process (tests), about the instance the message names."""
        try:
            self.roster.vet(claimed if reporter is None else reporter, claimed, info)
            return False
        except Refused as e:
            log.warning("registrar: %s refused: %s", what, e)
            return True

    async def on_heartbeat(self, beat: Heartbeat, reporter: str | None = None) -> HeartbeatReply | None:
        info = beat.info
        if self._refuses("heartbeat", reporter, info.id, info):
            return None  # no reply: a real instance that sees this has a config to mend
        if (heard := self.liveness.heard(beat, time.time())) is None:  # it hears nothing from here
            log.warning("registrar: %s missed %d heartbeat replies; not refreshed", info.id, beat.missed_replies)
            resync = await self.registry.index_state(info.id)
        else:  # the row and the index's state in one round trip
            resync = await self.registry.heard(info, heard.sampled_at, ttl_s=heard.ttl_s)
        forget = await self._gone(beat) if beat.holding else []
        return HeartbeatReply(resync_index=resync, forget=forget)

    async def _gone(self, beat: Heartbeat) -> list[str]:
        """Of the requests `beat` says it holds: records renewed, records lost in a Redis restart
        written again, and the rest (no record: ended or moved) named back to be dropped."""
        gone, epoch_at = await self.registry.renew_requests(beat.holding, self.request_ttl_s)
        now, held_s = time.time(), dict(zip(beat.holding, beat.held_s))
        # taken before Redis's data began, and not recorded again already (then it ended since)
        lost = [
            rid
            for rid in gone
            if now - held_s.get(rid, 0.0) < epoch_at and await self.registry.adopt(rid, self.request_ttl_s)
        ]
        for rid in lost:
            log.warning("registrar: %s's record was lost (Redis restarted); recorded again", rid)
            await self.registry.set_request(rid, {"holder": beat.info.id}, ttl_s=self.request_ttl_s)
        return [rid for rid in gone if rid not in lost]

    async def on_index(self, update: IndexUpdate, reporter: str | None = None) -> None:
        """Each update runs in its own task (Bus.serve): the instance's lock, taken in arrival
        order, has this registrar apply them in that order; Redis orders them across registrars."""
        if self._refuses("index update", reporter, update.instance_id):
            return
        async with self._index_lock.setdefault(update.instance_id, asyncio.Lock()):
            in_order = await self.registry.apply_index_update(update.instance_id, update)
        if not in_order:
            log.info(
                "registrar: index update %d of %s came after a gap: asking for the whole index",
                update.seq,
                update.instance_id,
            )

    async def on_leave(self, msg: Leave, reporter: str | None = None) -> None:
        if self._refuses("leave", reporter, msg.instance_id):
            return
        self._index_lock.pop(msg.instance_id, None)
        await self.registry.forget_index_order(msg.instance_id)
        await self.registry.remove(msg.instance_id)
