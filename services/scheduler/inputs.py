"""What the scheduler plans with, built from plain data: the policy's config, the view of an
instance, the dispatches its last heartbeat has not counted yet, and the KV on the line.

The scheduler service builds these from the cluster config and the registry; the simulator
(sim/) builds the same from its fleet, so both plan on exactly the same inputs with the same
`choose_plan`. No I/O here beyond reading the model's config.json.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from services.scheduler.policy import InstanceView, PolicyConfig, with_wire
from shared.config import ClusterConfig
from shared.messages import InstanceInfo
from shared.model_info import WIRE_FORMATS, load_model_info
from shared.pipelines import Role
from shared.policy_knobs import knob_values


def kv_bytes_per_token(cfg: ClusterConfig) -> int:
    """KV bytes of one token as main-decode stores it, from the model's config.json."""
    return load_model_info(cfg.model).kv_bytes_per_token(cfg.of_role(Role.MD)[0].dtype)


def policy_config(
    knobs: Mapping[str, Any],
    *,
    kv_bytes_per_token: int,
    rld_slots: int,
    wan_delay_ms: float,
    catchup_chunk: int,
    wire_bytes_per_token: Mapping[str, int] | None = None,
    **priors: float,
) -> PolicyConfig:
    """The policy's config: the operator's knobs (shared/policy_knobs.py, the `scheduler:`
    section's) plus what the fleet implies (KV size, relay slots, the line's delay, the catch-up
    chunk, each wire format's bytes per token) and optional priors (`prefill_tok_s`,
    `decode_step_ms`, `local_mbps`, ...) that override the knobs' defaults."""
    return PolicyConfig(
        **{**knobs, **priors},
        kv_bytes_per_token=kv_bytes_per_token,
        rld_slots=max(rld_slots, 1),
        wan_delay_ms=wan_delay_ms,
        catchup_chunk=catchup_chunk,
        wire_bytes_per_token=dict(wire_bytes_per_token or {}),
    )


def cluster_policy_config(cfg: ClusterConfig) -> PolicyConfig:
    """What the scheduler service plans with, from the cluster config."""
    model, md_dtype = load_model_info(cfg.model), cfg.of_role(Role.MD)[0].dtype
    return policy_config(
        knob_values(cfg.scheduler),
        kv_bytes_per_token=kv_bytes_per_token(cfg),
        rld_slots=sum(i.max_running for i in cfg.of_role(Role.RLD)),
        wan_delay_ms=cfg.wan.delay_ms,
        catchup_chunk=cfg.handoff.chunk_tokens,
        wire_bytes_per_token={w: model.kv_bytes_per_token(md_dtype, w) for w in WIRE_FORMATS},
    )


def instance_view(i: InstanceInfo, hit_tokens: int, unseen: int) -> InstanceView:
    """The policy's view of one instance: its last heartbeat, its prefix hit, and `unseen`
    dispatches made after that heartbeat (counted as pending and held)."""
    return InstanceView(
        i.id,
        i.role,
        i.dc,
        hit_tokens=hit_tokens,
        running=i.running,
        waiting=i.waiting,
        pending=i.pending + unseen,
        held=i.held + unseen,
        capacity=i.capacity,
        free_blocks=i.free_blocks,
        total_blocks=i.total_blocks,
        block_size=i.block_size,
        queued_tokens=i.queued_tokens,
        step_ms=i.step_ms or None,
        prefill_tok_s=i.prefill_tok_s or None,
        dtype=i.dtype,
    )


class Dispatched:
    """Decode tasks this scheduler sent that the target's last heartbeat cannot have counted yet.

    Heartbeats are `heartbeat_s` apart, and a burst plans many requests in between: without this
    every one of them sees the relay as it was at the last beat and the oscillation guard lets
    them all through. A dispatch counts as `pending` on its instance until a heartbeat written
    after it arrives (wall clock of site A: the registrar stamps `updated_at` when it hears the
    heartbeat, less the line's one-way delay for another site's instance; we stamp the dispatch).
    """

    def __init__(self) -> None:
        self._at: dict[str, list[float]] = {}
        # instance -> the earliest of its dispatches held: a heartbeat before it counts them all, so
        # the plans between two heartbeats (hundreds at fleet rates) count without filtering
        self._earliest: dict[str, float] = {}

    def add(self, instance_id: str, at: float) -> None:
        self._at.setdefault(instance_id, []).append(at)
        self._earliest[instance_id] = min(at, self._earliest.get(instance_id, at))

    def unseen(self, instance_id: str, heartbeat_at: float) -> int:
        if not (times := self._at.get(instance_id)):  # most instances, most plans: nothing sent lately
            return 0
        if self._earliest[instance_id] > heartbeat_at:
            return len(times)
        times = self._at[instance_id] = [t for t in times if t > heartbeat_at]
        self._earliest[instance_id] = min(times, default=math.inf)
        return len(times)


class Views:
    """The policy's views of the alive instances, for one plan after another.

    A view without a prefix hit depends on the heartbeat and the unseen dispatches alone: it is
    made again only when either changed (the live view's rows are replaced, never changed:
    services/scheduler/live_view.py), so a plan builds views for the few instances it hits or
    sent a task to since, not for all 200 of a fleet.
    """

    def __init__(self) -> None:
        # id -> (its heartbeat, unseen dispatches, its view without a hit): an instance is sent a
        # task every few hundred plans, so its count stays put from one plan to the next
        self._made: dict[str, tuple[InstanceInfo, int, InstanceView]] = {}

    def of(self, infos: Iterable[InstanceInfo], hits: Mapping[str, int], dispatched: Dispatched) -> list[InstanceView]:
        """`instance_view` of each of `infos`, with its hit and unseen dispatches."""
        out = []
        for info in infos:
            unseen = dispatched.unseen(info.id, info.updated_at)
            if hit := hits.get(info.id, 0):
                out.append(instance_view(info, hit, unseen))
                continue
            made = self._made.get(info.id)
            if made is None or made[0] is not info or made[1] != unseen:
                made = self._made[info.id] = (info, unseen, instance_view(info, 0, unseen))
            out.append(made[2])
        return out


def wan_kv_bytes(tokens: int, wire: str, config: PolicyConfig) -> int:
    """KV bytes of `tokens` tokens crossing the WAN in `wire`, as the plan's estimates weigh them."""
    return max(tokens, 0) * with_wire(config, wire).kv_bytes_per_token


class WanBacklog:
    """The line's backlog: KV bytes dispatched across the WAN that have not landed yet.

    The bandwidth estimate learns only from finished transfers; this is what is still on its way
    (`choose_plan`'s `wan_backlog_bytes`). A request's bytes are `add`ed when its plan, with KV
    crossing the WAN, is dispatched, and `settle`d when that KV lands (the decoder's `WanSample`
    names the request), when the request is aborted (which also stops its KV mid-way), or when
    its dispatch failed. An entry nothing settles (a push that failed for good: prefill drops
    only main-decode's copy, which the scheduler does not hear) expires `max_age_s` after its
    dispatch (timeouts.request_s: no request lives longer), so at most the requests dispatched
    in that span are held. Times are the caller's clock, non-decreasing across `add`s.
    """

    def __init__(self, max_age_s: float = math.inf) -> None:
        self.max_age_s = max_age_s
        self._owed: dict[str, tuple[float, int, str]] = {}  # request -> (dispatched at, bytes, to), oldest first
        self._total = 0

    def add(self, request_id: str, nbytes: int, at: float, to: str = "") -> None:
        """`to`: the decoder the bytes cross to (the only one whose sample settles them)."""
        self.settle(request_id)  # planned again: the new plan replaces the old one's bytes
        if nbytes > 0:
            self._owed[request_id] = (at, nbytes, to)
            self._total += nbytes

    def receiver(self, request_id: str) -> str | None:
        """The decoder `request_id`'s KV is crossing to; None when none is on the line for it."""
        owed = self._owed.get(request_id)
        return None if owed is None else owed[2]

    def settle(self, request_id: str) -> int:
        """Its KV landed or will not cross: its bytes leave the backlog (0 if it had none)."""
        _, nbytes, _ = self._owed.pop(request_id, (0.0, 0, ""))
        self._total -= nbytes
        return nbytes

    def total(self, now: float) -> int:
        """Bytes on the line now, after dropping entries older than `max_age_s`."""
        while self._owed:
            request_id, (at, _, _) = next(iter(self._owed.items()))
            if now - at <= self.max_age_s:
                break
            self.settle(request_id)
        return self._total

    def __len__(self) -> int:
        return len(self._owed)
