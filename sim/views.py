"""What the scheduler knows about each instance when it plans: live figures or heartbeats.

The real scheduler (services/scheduler/service.py, `_view`) plans on the registry: each
instance writes its figures to Redis every `heartbeat_s` (1 s) and the scheduler reads the last
one, so a figure can be up to a second old. It adds what those heartbeats cannot have counted
yet: every dispatch it made to an instance after that instance's last heartbeat counts as one
more `pending` and `held` there (`Dispatched`). Prefix hits come from the Redis block index,
which instances update as blocks are stored, so they are live here too.

A `ViewSpec` (the `views:` section of a sim config) chooses how faithful the sim is to that:
- `heartbeat_s` > 0: each instance "heartbeats" every `heartbeat_s` at its own phase (drawn
  from the run's seed, as processes start at different moments) and the policy sees the last
  one, plus the dispatches since. 0 (the default): figures are read live at the plan.
- `measured`: the views carry what the sim knows but the real heartbeat does not — a prefill's
  queued tokens and measured throughput, a decoder's last step time. False: they are left
  unset and the policy falls back on its configured priors (`prefill_tok_s`,
  `decode_step_ms`), as the real scheduler does. True (the default) keeps the idealised,
  better-informed scheduler the fleet experiments were run with.

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


def figures(inst: Instance, measured: bool) -> dict[str, Any]:
    """What a heartbeat of `inst` reports now (InstanceView's fields, less id, role, dc, hits)."""
    if isinstance(inst, PrefillInstance):
        out: dict[str, Any] = {"running": inst.running, "waiting": len(inst.queue)}
        if measured:
            out.update(queued_tokens=inst.queued_tokens, prefill_tok_s=inst.tok_s)
        return out
    running, waiting = len(inst.running), len(inst.waiting)
    out = {"running": running, "waiting": waiting, "pending": inst.pending, "held": running + waiting + inst.pending,
           "free_blocks": inst.free_blocks, "total_blocks": inst.total_blocks, "block_size": POOL_BLOCK}  # fmt: skip
    if measured:
        out["step_ms"] = inst.last_step_ms
    return out


class HeartbeatViews:
    """The registry as the scheduler reads it: last heartbeats plus unseen dispatches."""

    def __init__(self, loop: EventLoop, instances: list[Instance], spec: ViewSpec, seed: int = 0) -> None:
        self.loop, self.instances, self.spec = loop, instances, spec
        self.snapshots: dict[str, tuple[float, dict[str, Any]]] = {}  # id -> (heartbeat time ms, figures)
        self.dispatched: dict[str, list[float]] = {}
        self._beating = 0  # heartbeat events on the loop
        self._rng = random.Random(seed)

    def start(self) -> None:
        if self.spec.heartbeat_s <= 0:
            return
        every = self.spec.heartbeat_s * 1000.0
        for inst in self.instances:
            self.snapshots[inst.id] = (-1.0, figures(inst, self.spec.measured))  # registered at start, idle
            self._beating += 1
            self.loop.at(self.loop.now + self._rng.uniform(0.0, every), self._beat, inst)

    def _beat(self, inst: Instance) -> None:
        self._beating -= 1
        self.snapshots[inst.id] = (self.loop.now, figures(inst, self.spec.measured))
        if len(self.loop) > self._beating:  # something else can still happen
            self._beating += 1
            self.loop.after(self.spec.heartbeat_s * 1000.0, self._beat, inst)

    def dispatch(self, instance_ids: list[str]) -> None:
        if self.spec.heartbeat_s > 0:
            for iid in instance_ids:
                self.dispatched.setdefault(iid, []).append(self.loop.now)

    def _unseen(self, iid: str, heartbeat_ms: float) -> int:
        times = [t for t in self.dispatched.get(iid, ()) if t > heartbeat_ms]
        self.dispatched[iid] = times
        return len(times)

    def views(self, hits: dict[str, int]) -> list[InstanceView]:
        """`hits`: the request's prefix hit tokens per instance id (live, from the block index)."""
        out = []
        for inst in self.instances:
            if self.spec.heartbeat_s > 0:
                at, figs = self.snapshots[inst.id]
                unseen = self._unseen(inst.id, at)
                figs = {**figs, "pending": figs.get("pending", 0) + unseen, "held": figs.get("held", 0) + unseen}
            else:
                figs = figures(inst, self.spec.measured)
            out.append(InstanceView(inst.id, inst.role, inst.dc, hit_tokens=hits.get(inst.id, 0), **figs))
        return out
