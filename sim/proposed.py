"""Scheduler rules proposed for services/scheduler/policy.py, tried in the simulator first.

A config's `proposed: [NAME, ...]` applies these, in this file's order, after the scheduler's own
`choose_plan` (which the simulator still calls, unchanged, through `Context.plan`): each rule
takes the decision and may replace it with another `choose_plan` answer on changed inputs. Once
a rule is adopted into the scheduler it leaves this file.

- `line-backlog`: the p-md TTFT estimate counts the KV already queued on the line. Today
  `transfer_ms` divides a request's own bytes by the live bandwidth estimate, which learns only
  from transfers that have finished: a burst (the first seconds of a run, a surge of new
  sessions) is planned `p-md` request after request on an empty-looking line, and every one of
  them waits behind the others. The scheduler knows what it dispatched across the WAN and what
  has landed (`WanSample`, the request's end): the bytes in between are the line's backlog, and
  a new transfer finishes no sooner than (backlog + its own bytes) / bandwidth. Emulated here by
  planning on the bandwidth that gives that time (own / (own + backlog) of the estimate).
  In the scheduler: `choose_plan(..., wan_backlog_bytes=...)`, and in `estimate_ttft` for a
  decoder across the WAN: `transfer_ms(lacking, kv, link) + wan_backlog_bytes / (link.mbps * 125)`;
  the service keeps `wan_backlog_bytes` += the plan's (prompt_len - md_cached_tokens) *
  kv_bytes_per_token when it dispatches across the WAN, -= the same when that KV lands or the
  request ends.
- `relay-finishes`: a request the policy sends through the relay (`p-rld-md`, reason
  slo-miss-relay) whose expected relay backlog covers its whole answer budget
  (`estimates.backlog_tokens >= max_tokens`: MD's KV cannot land before the relay has streamed
  every token) runs `p-rld` instead [relay-finishes]. The user sees the same tokens from the same
  relay; MD is not sent a KV it would drop, so the line carries only KV that MD will use. The
  guard (rule 5) still comes first: a saturated relay sends the request to `p-md`.
  In policy.py: in `choose_pipeline`, between the guard and the final `p-rld-md`,
      if expected_backlog(req, rld, ttft, config) >= req.max_tokens:
          return Pipeline.P_RLD, "relay-finishes"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.policy import Decision, InstanceView, PlanRequest, PolicyConfig
from shared.pipelines import Pipeline


@dataclass(frozen=True)
class Context:
    """What a rule may use: the plan's inputs, the scheduler's function, and the line's backlog."""

    views: list[InstanceView]
    config: PolicyConfig
    wan_mbps: float
    plan: Callable[..., Decision]  # choose_plan
    wan_backlog_bytes: float = 0.0  # KV dispatched across the WAN that has not landed yet


def line_backlog(d: Decision, req: PlanRequest, ctx: Context) -> Decision:
    if "md" not in d.instances or ctx.wan_backlog_bytes <= 0:
        return d
    own = (req.prompt_len - d.md_cached_tokens) * ctx.config.kv_bytes_per_token
    if own <= 0:
        return d
    slower = ctx.wan_mbps * own / (own + ctx.wan_backlog_bytes)
    return ctx.plan(req, ctx.views, ctx.config, wan_mbps=slower)


def relay_finishes(d: Decision, req: PlanRequest, ctx: Context) -> Decision:
    if d.pipeline != Pipeline.P_RLD_MD or d.reason != "slo-miss-relay" or d.estimates.backlog_tokens < req.max_tokens:
        return d
    alone = ctx.plan(
        dataclasses.replace(req, pipeline=Pipeline.P_RLD.value), ctx.views, ctx.config, wan_mbps=ctx.wan_mbps
    )
    return dataclasses.replace(alone, reason="relay-finishes", estimates=d.estimates)


RULES: dict[str, Callable[[Decision, PlanRequest, Context], Decision]] = {
    "line-backlog": line_backlog,
    "relay-finishes": relay_finishes,
}


def check(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    unknown = sorted(set(names) - set(RULES))
    if unknown:
        raise ValueError(f"proposed: unknown rule(s) {unknown}; known: {sorted(RULES)}")
    return tuple(name for name in RULES if name in names)  # this file's order
