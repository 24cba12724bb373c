"""Scheduling policy: a pure function from plain data to a plan. No I/O, no torch, no NATS.

`choose_plan(request, instances, config) -> Decision`

Rules (this revision):
1. A forced pipeline/handoff (the request's `pdd` override) is honoured; otherwise the
   configured default pipeline (`p-rld-md`) is used, or `p-md` when no relay is alive.
2. Each role's instance is the alive one with the lowest cost, skipping any instance the
   request already failed on (`avoid`). Cost trades load against prefix hit, as SGLang's
   cache-aware router and Dynamo's KV router do: `load - hit_weight * hit_tokens / prompt_len`,
   so a warm instance wins unless it is much busier.
3. A decoder is sent only the KV it lacks: its start is its prefix hit (`md_cached_tokens`
   for main-decode), whole blocks only.
4. No alive instance of a needed role -> `NoCapacity` (the gateway answers 503).
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
    hit_tokens: int = 0  # prefix of this request the instance holds (from the Redis index)


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
    hit_weight: float = 1.0


@dataclass(frozen=True)
class Decision:
    pipeline: str
    handoff: str
    instances: dict[str, str] = field(default_factory=dict)  # role -> instance id
    md_cached_tokens: int = 0
    starts: dict[str, int] = field(default_factory=dict)  # role -> first token the decoder needs
    reason: str = ""


def cheapest(instances: list[InstanceView], role: str, req: PlanRequest, config: PolicyConfig) -> InstanceView:
    candidates = [i for i in instances if i.role == role and i.id not in req.avoid]
    if not candidates:
        raise NoCapacity(f"no alive {role} instance")
    scale = config.hit_weight / max(req.prompt_len, 1)
    return min(candidates, key=lambda i: (i.load - scale * i.hit_tokens, i.id))


def choose_plan(req: PlanRequest, instances: list[InstanceView], config: PolicyConfig) -> Decision:
    pipeline, reason = config.default_pipeline, "default"
    if req.pipeline is not None:
        pipeline, reason = req.pipeline, "forced"
    elif "rld" in ROLES_OF[pipeline] and not any(i.role == "rld" and i.id not in req.avoid for i in instances):
        pipeline, reason = "p-md", "no-relay-alive"
    roles = ROLES_OF[pipeline]
    picked = {role: cheapest(instances, role, req, config) for role in roles}
    handoff = "none"
    if "rld" in roles and "md" in roles:
        handoff = req.handoff or config.default_handoff
    starts = {role: min(i.hit_tokens, req.prompt_len) for role, i in picked.items() if role != "prefill"}
    return Decision(
        pipeline=pipeline,
        handoff=handoff,
        instances={role: i.id for role, i in picked.items()},
        md_cached_tokens=starts.get("md", 0),
        starts=starts,
        reason=reason,
    )
