"""Constructed fleets and requests for the policy tests (no servers)."""

from __future__ import annotations

from services.scheduler.policy import InstanceView, PlanRequest


def view(instance_id: str, **figures) -> InstanceView:
    """`prefill-0`, `rld-1`, `md-0`, ...: role from the name; MD in datacenter B, the rest in A."""
    role = instance_id.rsplit("-", 1)[0]
    return InstanceView(instance_id, role, "B" if role == "md" else "A", **figures)


def fleet(*ids: str, **figures_by_id: dict) -> list[InstanceView]:
    """One prefill, one relay and one main decoder unless ids say otherwise; figures per id
    with `-` spelt `_` (`md_0={"hit_tokens": 960}`)."""
    ids = ids or ("prefill-0", "rld-0", "md-0")
    return [view(i, **figures_by_id.get(i.replace("-", "_"), {})) for i in ids]


def request(prompt_len: int = 1500, max_tokens: int = 600, **kw) -> PlanRequest:
    return PlanRequest("r", prompt_len, max_tokens, **kw)
