"""What the scheduler knows about each instance when it plans: live figures or heartbeats.

The real scheduler (services/scheduler/service.py) plans on the registry: each instance writes
an `InstanceInfo` heartbeat every `heartbeat_s` (1 s) and the scheduler reads the last one, so a
figure can be up to a second old. It adds what those heartbeats cannot have counted yet: every
dispatch it made to an instance after that heartbeat counts as one more `pending` and `held`
there. Prefix hits come from the Redis block index, which instances update as blocks are stored,
so they are live here too. The simulator builds the same inputs with the same functions:
`InstanceInfo` snapshots of its instances, `services.scheduler.inputs.instance_view` to turn
one into the policy's view, `inputs.Dispatched` to count the unseen dispatches (times in
simulated seconds).

A `ViewSpec` (the `views:` section of a sim config) chooses how faithful the sim is to that:
- `heartbeat_s` > 0: each instance "heartbeats" every `heartbeat_s` at its own phase (drawn
  from the run's seed, as processes start at different moments) and the policy sees the last
  one, plus the dispatches since. 0 (the default): figures are read live at the plan.
- `measured`: the heartbeats carry a prefill's queued tokens and measured throughput and a
  decoder's last step time, as the real ones do since commit b4f8484. False: they are left
  unset and the policy falls back on its configured priors (`prefill_tok_s`,
  `decode_step_ms`), as the real scheduler did before. True is the default.

What a simulated instance reports (`info`): as the real engine does (shared/instance.py
`Engine.figures`), running, waiting, pending, held and its KV pool; the pool counts as used only
what running sequences reserve (a prefill's pool and a decoder's DRC hold evictable cache, which
the simulator counts as free).

Lifecycle of the figures (`HeartbeatViews`):
1. `start`: every instance's first heartbeat is scheduled at its phase.
2. Each heartbeat snapshots the instance's figures, stamped with the time, and schedules the
   next one; the chain stops once only heartbeats are left on the loop (nothing can change).
3. `dispatch`: the policy sent a request to these instances (stamped now).
4. `views`: one `InstanceView` per instance, from its snapshot (or live), with the unseen
   dispatches added and the request's live prefix hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any

from services.scheduler.estimates import InstanceView
from services.scheduler.inputs import Dispatched, instance_view
from shared.messages import InstanceInfo
from sim.decoder import POOL_BLOCK, DecodeInstance
from sim.events import EventLoop
from sim.prefill import PrefillInstance

Instance = PrefillInstance | DecodeInstance


@dataclass(frozen=True)
class ViewSpec:
    heartbeat_s: float = 0.0
    measured: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_s < 0:
            raise ValueError(f"views.heartbeat_s must be >= 0, got {self.heartbeat_s!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ViewSpec:
        raw = dict(raw or {})
        raw.pop("sources", None)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"views: unknown key(s) {unknown}")
        return cls(**raw)


def info(inst: Instance, measured: bool, now_s: float) -> InstanceInfo:
    """The heartbeat `inst` would write now (`updated_at` in simulated seconds)."""
    total = inst.profile.kv_tokens // POOL_BLOCK
    out = InstanceInfo(inst.id, inst.role, inst.dc, block_size=POOL_BLOCK, total_blocks=total, updated_at=now_s)
    if isinstance(inst, PrefillInstance):
        out.running, out.waiting, out.free_blocks = inst.running, len(inst.queue), total
        out.held = out.running + out.waiting
        if measured:
            out.queued_tokens, out.prefill_tok_s = inst.queued_tokens, inst.tok_s
        return out
    out.running, out.waiting, out.pending = len(inst.running), len(inst.waiting), inst.pending
    out.held, out.free_blocks = out.running + out.waiting + out.pending, inst.free_blocks
    if measured:
        out.step_ms = inst.last_step_ms or 0.0
    return out


class HeartbeatViews:
    """The registry as the scheduler reads it: last heartbeats plus unseen dispatches."""

    def __init__(self, loop: EventLoop, instances: list[Instance], spec: ViewSpec, seed: int = 0) -> None:
        self.loop, self.instances, self.spec = loop, instances, spec
        self.snapshots: dict[str, InstanceInfo] = {}  # id -> its last heartbeat
        self.dispatched = Dispatched()
        self._beating = 0  # heartbeat events on the loop
        self._rng = random.Random(seed)

    def start(self) -> None:
        if self.spec.heartbeat_s <= 0:
            return
        every = self.spec.heartbeat_s * 1000.0
        for inst in self.instances:
            self.snapshots[inst.id] = info(inst, self.spec.measured, -1e-3)  # registered at start, idle
            self._beating += 1
            self.loop.at(self.loop.now + self._rng.uniform(0.0, every), self._beat, inst)

    def _beat(self, inst: Instance) -> None:
        self._beating -= 1
        self.snapshots[inst.id] = info(inst, self.spec.measured, self.loop.now / 1000.0)
        if len(self.loop) > self._beating:  # something else can still happen
            self._beating += 1
            self.loop.after(self.spec.heartbeat_s * 1000.0, self._beat, inst)

    def dispatch(self, instance_ids: list[str]) -> None:
        if self.spec.heartbeat_s > 0:
            for iid in instance_ids:
                self.dispatched.add(iid, self.loop.now / 1000.0)

    def views(self, hits: dict[str, int]) -> list[InstanceView]:
        """`hits`: the request's prefix hit tokens per instance id (live, from the block index)."""
        out = []
        for inst in self.instances:
            if self.spec.heartbeat_s > 0:
                beat = self.snapshots[inst.id]
                unseen = self.dispatched.unseen(inst.id, beat.updated_at)
            else:
                beat, unseen = info(inst, self.spec.measured, self.loop.now / 1000.0), 0
            out.append(instance_view(beat, hits.get(inst.id, 0), unseen))
        return out
