"""The scheduler's view of the alive instances, kept in memory from the heartbeats themselves.

Every scheduler hears every heartbeat and every leave (a plain subscription beside its
registrar's queue-group one) and keeps each instance's last figures with the registrar's own
liveness rule (`registrar.Liveness`), so a plan reads no registry: re-reading 200 instances'
rows from Redis cost ~40 ms of a scheduler's CPU per plan (benchmarks/fleet_bench.py). Redis
stays the registry others read (the gateway, `pdd status`, a scheduler that just started: the
view answers only once it has listened for a whole TTL, when it holds everything Redis would).
The same holds after its NATS connection drops (a server died): heartbeats sent meanwhile never
reach it, so it answers None again until it has listened a whole TTL since it got back.
"""

from __future__ import annotations

import time

from services.scheduler.registrar import Liveness, Refused, Roster
from shared.messages import Heartbeat, InstanceInfo, Leave


class LiveView:
    def __init__(self, liveness: Liveness, now: float | None = None, roster: Roster | None = None) -> None:
        self.liveness = liveness
        self.roster = roster or Roster()  # the registrar's vetting: the view takes no report it refuses
        # id -> (alive until, wall clock; last figures), by id once `_in_order` (a heartbeat replaces
        # its row in place: only a newcomer puts the rows out of order)
        self._rows: dict[str, tuple[float, InstanceInfo]] = {}
        self._in_order = True
        self._since = time.time() if now is None else now  # listening since

    def link(self, up: bool, now: float | None = None) -> None:
        """The view's NATS connection was lost (`up` False) or is back: deaf from the loss until a
        whole TTL after it is back."""
        self._since = (time.time() if now is None else now) if up else float("inf")

    def heard(self, beat: Heartbeat, reporter: str | None = None, now: float | None = None) -> None:
        try:
            self.roster.vet(beat.info.id if reporter is None else reporter, beat.info.id, beat.info)
        except Refused:
            return  # the registrar logs it
        now = time.time() if now is None else now
        if (heard := self.liveness.heard(beat, now)) is not None:
            beat.info.updated_at = heard.sampled_at
            self._in_order = self._in_order and beat.info.id in self._rows
            self._rows[beat.info.id] = (now + heard.ttl_s, beat.info)

    def left(self, msg: Leave, reporter: str | None = None) -> None:
        if reporter in (None, msg.instance_id):
            self._rows.pop(msg.instance_id, None)

    def alive(self, now: float | None = None) -> list[InstanceInfo] | None:
        """The instances alive now, by id; None while it has not listened for a whole TTL yet
        (an instance heard of only in Redis so far may be missing: ask Redis)."""
        now = time.time() if now is None else now
        if now - self._since < self.liveness.ttl_s + self.liveness.heartbeat_s:
            return None
        if not self._in_order:
            self._rows = dict(sorted(self._rows.items()))
            self._in_order = True
        alive = [info for until, info in self._rows.values() if until > now]
        if len(alive) < len(self._rows):
            for iid in [iid for iid, (until, _) in self._rows.items() if until <= now]:
                del self._rows[iid]
        return alive
