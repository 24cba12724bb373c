"""Scheduling policy: a pure function from plain data to a plan. No I/O, no torch, no NATS.

`choose_plan(request, instances, config) -> Decision`

Rules (this revision):
1. A forced pipeline/handoff (the request's `pdd` override) is honoured; otherwise the
   configured default pipeline (`p-rld-md`) is used, or `p-md` when no relay is alive.
2. Each role's instance is the alive one with the lowest load (ties by id), skipping any
   instance the request already failed on (`avoid`).
3. No alive instance of a needed role -> `NoCapacity` (the gateway answers 503).
The scheduler, the benchmarks and any simulator call this same function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINES = ("p-md", "p-rld-md", "p-rld")
HANDOFFS = ("oneshot", "catchup")
ROLES_OF = {"p-md": ("prefill", "md"), "p-rld-md": ("prefill", "rld", "md"), "p-rld": ("prefill", "rld")}


class NoCapacity(Exception):
    """No alive instance can take a role this request needs."""


@dataclass(frozen=True)
class InstanceView:
    id: str
    role: str
    dc: str
    load: float = 0.0


@dataclass(frozen=True)
class PlanRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    pipeline: str | None = None
    handoff: str | None = None
    avoid: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PolicyConfig:
    default_pipeline: str = "p-rld-md"
    default_handoff: str = "oneshot"


@dataclass(frozen=True)
class Decision:
    pipeline: str
    handoff: str
    instances: dict[str, str] = field(default_factory=dict)  # role -> instance id
    md_cached_tokens: int = 0
    reason: str = ""


def least_loaded(instances: list[InstanceView], role: str, avoid: frozenset[str]) -> InstanceView:
    candidates = [i for i in instances if i.role == role and i.id not in avoid]
    if not candidates:
        raise NoCapacity(f"no alive {role} instance")
    return min(candidates, key=lambda i: (i.load, i.id))


def choose_plan(req: PlanRequest, instances: list[InstanceView], config: PolicyConfig) -> Decision:
    pipeline, reason = config.default_pipeline, "default"
    if req.pipeline is not None:
        pipeline, reason = req.pipeline, "forced"
    elif "rld" in ROLES_OF[pipeline] and not any(i.role == "rld" and i.id not in req.avoid for i in instances):
        pipeline, reason = "p-md", "no-relay-alive"
    roles = ROLES_OF[pipeline]
    chosen = {role: least_loaded(instances, role, req.avoid).id for role in roles}
    handoff = "none"
    if "rld" in roles and "md" in roles:
        handoff = req.handoff or config.default_handoff
    return Decision(pipeline=pipeline, handoff=handoff, instances=chosen, reason=reason)
