"""Scheduling policy: a pure function from plain data to a plan. No I/O, no torch, no NATS.

`choose_plan(request, instances, config, wan_mbps=None, wan_backlog_bytes=0.0) -> Decision`

`instances` are the alive ones: an instance that missed its heartbeats has expired from the
registry and is simply absent. `wan_mbps` is the live WAN estimate (`BandwidthEstimator`);
None = the configured prior. `wan_backlog_bytes` is the line's backlog: KV already dispatched
across the WAN that has not landed (services/scheduler/inputs.py `WanBacklog`). The bandwidth
estimate learns only from finished transfers, so in a burst the line looks empty request after
request; with `line_backlog` a transfer to MD is estimated to finish behind that backlog
(services/scheduler/estimates.py). The scheduler, the benchmarks and the simulator call this function.

Pipeline (`config.default_pipeline == "auto"`; first rule that applies, `reason` in brackets):
1. The request forces one (its `pdd` override) [forced].
2. Anomalous traffic: long uncached input (prompt_len - best prefill/MD hit >=
   `anomalous_min_uncached`) with a short output budget (max_tokens < `anomalous_max_output`)
   runs on RLD alone, `p-rld`, and never crosses the WAN [anomalous]. Nothing else gets p-rld
   but rules 3 and 6: low-hit traffic finishing on RLD overloads the small pool and the
   pipeline oscillates.
3. No main-decode alive (datacenter B unreachable: the line is down) and a relay alive ->
   `p-rld`: datacenter A serves on its own [no-md-alive].
   No relay alive -> `p-md` [no-relay-alive]; every relay full (see below) -> `p-md` [rld-full].
4. Estimated TTFT through MD meets the SLO (typically a high hit: little KV crosses) ->
   `p-md` [slo-met-md]. The SLO is the request's own when it has one (an admin's
   `pdd.ttft_slo_ms`: a class of traffic with a tighter or looser target), else `ttft_slo_ms`.
5. Oscillation guard (RLD admission control): the relay is busy with `rld_slots` requests or
   more (`rld_busy`: running, queued, or planned with the KV on its way) -> `p-md`, paying the
   TTFT penalty rather than piling onto RLD [rld-saturated]. With `guard=False` the request goes to RLD anyway.
6. The expected backlog (below) covers the whole answer budget (>= max_tokens): MD's KV cannot
   land before the relay has streamed every token, so the request runs `p-rld` and MD is not
   sent a KV it would drop [relay-finishes] (`relay_finishes`). The relay holds it exactly as
   long as under `p-rld-md`; the line carries only KV that MD will use.
7. Otherwise `p-rld-md`: RLD streams while MD's KV is on the wire [slo-miss-relay].
A pinned `default_pipeline` (`p-md`, `p-rld-md`: baselines and ablations) replaces 2-7 [default],
falling back to `p-md` when no relay is alive [no-relay-alive].

KV wire format over the WAN (`kv_wire_reason` in brackets), chosen before the pipeline, whose
estimates then use its bytes: a configured format [configured]; with `kv_wire = "auto"`, the
widest of native, bf16, int8 whose p-md TTFT estimate meets the SLO [slo-met for native,
narrowed-for-slo otherwise], else int8 [narrowest]. Narrower KV trades a little accuracy for
WAN bytes (docs/kv-wire.md measures how little).

Main-decode's suffix (`md_suffix_reason` in brackets), weighed for the MD instance before the
pipeline, whose p-md estimate then counts it; it applies when the plan has main-decode (p-md,
p-rld-md; the relay's KV is pushed as ever). The suffix is what MD lacks, prompt_len - its hit.
Rather than receive the suffix's KV, MD may compute it itself (Dynamo's conditional
disaggregation): its start is then prompt_len, prefill (which still computes the whole prompt
and samples the first token) pushes a transfer with no KV, and MD extends [hit, prompt_len) and
the first token in one pass before it decodes. First rule that applies:
- `md_suffix_max_tokens` is 0 [off].
- Prefill and MD run in different dtypes [dtypes-differ]: MD's own KV of the suffix (bfloat16
  in the shipped fleet) would not be prefill's float32 KV and the answer would change. In one
  dtype it is prefill's bit for bit (the batch-invariant kernels): the same answer either way.
- The suffix is longer than `md_suffix_max_tokens` [over-cap]: one long extend would stall MD's
  other decodes.
- MD's extend (suffix / its measured prefill tok/s, else the `prefill_tok_s` prior) is shorter
  than the push's line time (suffix * wire bytes per token / bandwidth, behind the line's backlog
  when `line_backlog` counts it; the one-way delay is paid either way) [extend-cheaper]: MD
  computes it, no KV of this request crosses and the line's backlog does not count it. Both
  grow with the suffix, so without a backlog this is MD's prefill rate against the tokens per
  second the line carries: at 200 Mbps, 542 tok/s of SmolLM2's float32 KV.
- Otherwise the KV is pushed [push-cheaper]. `estimates.md_push_ms` / `md_extend_ms` record the
  two figures whenever they were weighed.
Nothing is weighed ("") when MD holds the whole prompt or the plan has no MD.

Handoff of `p-rld-md` (`handoff_reason` in brackets): the request's hint [forced], else a pinned
`default_handoff` [default], else from RLD's live load and the expected backlog, i.e. the tokens
RLD will have produced before MD can take over: (TTFT via MD - TTFT via RLD) / RLD step time.
- RLD under pressure (busy >= `rld_pressure` * `rld_slots`) -> one-shot, handing
  off as early as possible so the slot frees at once [rld-pressure].
- Backlog > `catchup_threshold` -> catch-up in chunks of `catchup_chunk` tokens: many small
  extends on MD instead of one visible stall, RLD keeps streaming meanwhile [backlog].
- Otherwise -> one-shot: one small extend is imperceptible [small-backlog].

Instances: per role, the alive one with the lowest cost, never one the request already failed
on (`avoid`). Cost trades load against prefix hit, as SGLang's cache-aware router and Dynamo's
KV router do: `load - hit_weight * hit_tokens / prompt_len`, where load is the KV pool's used
share + 0.1 per running, waiting or pending request (the registry's `load` when those are unknown), +1
when the instance lacks the free blocks this request needs. A decoder is sent only the KV it
lacks: its start is its prefix hit (whole blocks), or the prompt's end on MD's suffix path. An
instance that holds `capacity` requests (max_running + max_waiting: the stage's bounded queue) is
full and skipped. No alive instance of a needed role -> `NoCapacity` (the gateway answers 503);
alive but all full -> `Saturated` (429).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from services.scheduler.estimates import InstanceView, Link, estimate_ttft, extend_ms, push_ms, step_ms_of
from shared.messages import PlanEstimates
from shared.model_info import AUTO_WIRE, WireFormat
from shared.pipelines import ROLES_OF, Handoff, Pipeline, Role
from shared.policy_knobs import AUTO, PolicyKnobs, check_positive

__all__ = [
    "Decision",
    "InstanceView",
    "NoCapacity",
    "PlanRequest",
    "PolicyConfig",
    "Saturated",
    "choose_plan",
]

QUEUE_WEIGHT = 0.1  # occupancy per request running, waiting or pending
NO_ROOM_PENALTY = 1.0  # an instance that would have to evict or wait for blocks


class NoCapacity(Exception):
    """No alive instance can take a role this request needs (the gateway answers 503)."""

    status = 503


class Saturated(NoCapacity):
    """Instances of a needed role are alive but every one is full (429: try again shortly)."""

    status = 429


@dataclass(frozen=True)
class PlanRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    pipeline: str | None = None
    handoff: str | None = None
    avoid: frozenset[str] = frozenset()  # instances this request already failed on
    kv_wire: str | None = None  # forced WAN wire format
    ttft_slo_ms: float | None = None  # the request's own TTFT SLO, else the configured one


@dataclass(frozen=True)
class PolicyConfig(PolicyKnobs):
    """The operator's knobs (shared/policy_knobs.py: each, its default and its check) plus what
    the fleet fixes, which services/scheduler/inputs.py derives (the defaults: SmolLM2 on the
    single-host demo)."""

    kv_bytes_per_token: int = 46_080  # SmolLM2-135M, fp32: 30 layers * 2 * 3 heads * 64 * 4 B
    wan_delay_ms: float = 10.0  # one way
    local_mbps: float = 10_000.0  # in-DC KV path
    rld_slots: int = 32  # requests the relay pool should hold (its max_running)
    catchup_chunk: int = 64  # tokens per catch-up chunk
    wire_bytes_per_token: dict[str, int] = field(default_factory=dict)  # format -> WAN bytes per token

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_bytes_per_token", "local_mbps", "rld_slots", "catchup_chunk"):
            check_positive(self, name)


@dataclass(frozen=True)
class Decision:
    pipeline: str
    handoff: str
    prefill: str = ""  # the instance of each role it runs on, as a `Plan` names them ("": none)
    rld: str = ""
    md: str = ""
    md_cached_tokens: int = 0
    starts: dict[str, int] = field(default_factory=dict)  # role -> first token the decoder needs
    reason: str = ""  # why this pipeline
    handoff_reason: str = ""  # why this handoff ("" when there is none)
    chunk_tokens: int = 0  # catch-up chunk size; 0 unless the handoff is catch-up
    estimates: PlanEstimates = field(default_factory=PlanEstimates)
    kv_wire: str = WireFormat.NATIVE  # how KV crosses the WAN for this request
    kv_wire_reason: str = ""
    md_computes_suffix: int = 0  # prompt tokens MD computes itself instead of receiving their KV
    md_suffix_reason: str = ""

    @property
    def instance_ids(self) -> list[str]:
        return [i for i in (self.prefill, self.rld, self.md) if i]


# -- instance choice ------------------------------------------------------------------------
def occupancy(v: InstanceView) -> float:
    """How busy an instance is: the share of its KV pool in use, plus its queued requests."""
    queued = v.running + v.waiting + v.pending
    if v.total_blocks <= 0 and not queued:
        return v.occupancy  # the view carries no pool or queue figures
    used = 1.0 - v.free_blocks / v.total_blocks if v.total_blocks > 0 else 0.0
    return used + QUEUE_WEIGHT * queued


def cost(v: InstanceView, req: PlanRequest, config: PolicyConfig) -> float:
    hit = min(v.hit_tokens, req.prompt_len)
    need = req.prompt_len - hit + (req.max_tokens if v.role != Role.PREFILL else 0)
    no_room = v.total_blocks > 0 and math.ceil(need / v.block_size) > v.free_blocks
    return occupancy(v) + NO_ROOM_PENALTY * no_room - config.hit_weight * hit / max(req.prompt_len, 1)


def is_full(v: InstanceView) -> bool:
    return v.capacity > 0 and v.held >= v.capacity


def cheapest(instances: list[InstanceView], role: Role, req: PlanRequest, config: PolicyConfig) -> InstanceView:
    """The instance of `role` that costs least (ties: the smaller id) among those neither avoided
    nor full. One pass, no key tuples: a fleet's plan weighs every instance of the role."""
    best, best_cost, failed, full = None, math.inf, [], []
    for i in instances:
        if i.role != role:
            continue
        if i.id in req.avoid:
            failed.append(i.id)
        elif is_full(i):
            full.append(i.id)
        elif (c := cost(i, req, config)) < best_cost or c == best_cost and i.id < best.id:
            best, best_cost = i, c
    if best is not None:
        return best
    if not full:
        raise NoCapacity(
            f"no alive {role} instance"
            + (f" but {', '.join(sorted(failed))}, which failed this request" if failed else "")
        )
    raise Saturated(f"every {role} instance is full ({', '.join(sorted(full))})")


# -- rules ----------------------------------------------------------------------------------
def uncached_tokens(req: PlanRequest, instances: list[InstanceView]) -> int:
    """What no prefill or MD instance holds: the KV that must be computed and would cross the WAN."""
    hits = [i.hit_tokens for i in instances if i.role in (Role.PREFILL, Role.MD) and i.id not in req.avoid]
    return max(req.prompt_len - max(hits, default=0), 0)


def is_anomalous(req: PlanRequest, uncached: int, config: PolicyConfig) -> bool:
    return uncached >= config.anomalous_min_uncached and req.max_tokens < config.anomalous_max_output


def rld_busy(rld: InstanceView) -> int:
    """Requests the relay is committed to: running, queued, and planned whose KV is on its way."""
    return rld.running + rld.waiting + rld.pending


def choose_pipeline(
    req: PlanRequest,
    rld: InstanceView | None,
    md_alive: bool,
    ttft: dict[str, float],
    uncached: int,
    config: PolicyConfig,
    backlog: int = 0,
) -> tuple[str, str]:
    """Rules 1-7 (above); `backlog` is `expected_backlog` on the relay (0 when there is none)."""
    if req.pipeline is not None:
        return req.pipeline, "forced"
    if config.default_pipeline != AUTO:
        if config.default_pipeline == Pipeline.P_RLD_MD and rld is None:
            return Pipeline.P_MD, "no-relay-alive"
        return config.default_pipeline, "default"
    if rld is not None and is_anomalous(req, uncached, config):
        return Pipeline.P_RLD, "anomalous"
    if rld is not None and not md_alive:
        return Pipeline.P_RLD, "no-md-alive"
    if rld is None:
        return Pipeline.P_MD, "no-relay-alive"
    if ttft.get(Pipeline.P_MD, math.inf) <= config.ttft_slo_ms:  # no MD: the plan fails on its missing role
        return Pipeline.P_MD, "slo-met-md"
    if config.guard and rld_busy(rld) >= config.rld_slots:
        return Pipeline.P_MD, "rld-saturated"
    if config.relay_finishes and backlog >= req.max_tokens:
        return Pipeline.P_RLD, "relay-finishes"
    return Pipeline.P_RLD_MD, "slo-miss-relay"


def expected_backlog(req: PlanRequest, rld: InstanceView, ttft: dict[str, float], config: PolicyConfig) -> int:
    """Tokens RLD streams before MD is ready to take over (MD's lag over the relay / RLD's step)."""
    if Pipeline.P_MD not in ttft or Pipeline.P_RLD_MD not in ttft:
        return 0
    lag_ms = max(ttft[Pipeline.P_MD] - ttft[Pipeline.P_RLD_MD], 0.0)
    return min(math.ceil(lag_ms / step_ms_of(rld, config)), req.max_tokens)


def choose_handoff(req: PlanRequest, rld: InstanceView, backlog: int, config: PolicyConfig) -> tuple[str, str]:
    if req.handoff is not None:
        return req.handoff, "forced"
    if config.default_handoff != AUTO:
        return config.default_handoff, "default"
    if rld_busy(rld) >= config.rld_pressure * config.rld_slots:
        return Handoff.ONESHOT, "rld-pressure"
    if backlog > config.catchup_threshold:
        return Handoff.CATCHUP, "backlog"
    return Handoff.ONESHOT, "small-backlog"


AUTO_WIRES = (WireFormat.NATIVE, WireFormat.BF16, WireFormat.INT8)  # widest first: narrow only as far as the SLO needs


def with_wire(config: PolicyConfig, wire: str) -> PolicyConfig:
    """The estimates' priors with the WAN carrying `wire` bytes per token."""
    return dataclasses.replace(
        config, kv_bytes_per_token=config.wire_bytes_per_token.get(wire, config.kv_bytes_per_token)
    )


def choose_wire(
    req: PlanRequest,
    prefill: InstanceView,
    md: InstanceView | None,
    config: PolicyConfig,
    wan: Link,
    wan_backlog_bytes: float = 0.0,
) -> tuple[str, str]:
    if req.kv_wire is not None:
        return req.kv_wire, "forced"
    if config.kv_wire != AUTO_WIRE:
        return config.kv_wire, "configured"
    if md is None:
        return WireFormat.NATIVE, "no-wan"
    for wire in AUTO_WIRES:
        priors = with_wire(config, wire)
        ttft = estimate_ttft(Pipeline.P_MD, req.prompt_len, prefill, md, priors, wan, wan_backlog_bytes).total_ms
        if ttft <= config.ttft_slo_ms:
            return wire, "slo-met" if wire == WireFormat.NATIVE else "narrowed-for-slo"
    return AUTO_WIRES[-1], "narrowest"


@dataclass(frozen=True)
class Suffix:
    """Whether MD computes the suffix of the prompt it lacks itself, why, and the figures weighed."""

    tokens: int = 0  # the suffix MD computes (0: its KV is pushed, or MD lacks nothing)
    reason: str = ""
    push_ms: float = 0.0
    extend_ms: float = 0.0


def choose_suffix(
    req: PlanRequest, prefill: InstanceView, md: InstanceView, priors: PolicyConfig, wan: Link, line: float
) -> Suffix:
    """The suffix rule (above); `priors` carry the chosen wire's bytes per token, `line` the
    backlog the estimates count."""
    suffix = req.prompt_len - min(md.hit_tokens, req.prompt_len)
    if suffix == 0:
        return Suffix()
    if priors.md_suffix_max_tokens == 0:
        return Suffix(reason="off")
    if prefill.dtype != md.dtype:
        return Suffix(reason="dtypes-differ")
    if suffix > priors.md_suffix_max_tokens:
        return Suffix(reason="over-cap")
    across = md.dc != prefill.dc
    link = wan if across else Link(priors.local_mbps)
    push = push_ms(suffix, priors.kv_bytes_per_token, link, line if across else 0.0)
    extend = extend_ms(suffix, md, priors)
    if extend < push:
        return Suffix(suffix, "extend-cheaper", push_ms=push, extend_ms=extend)
    return Suffix(0, "push-cheaper", push_ms=push, extend_ms=extend)


# -- the plan -------------------------------------------------------------------------------
def choose_plan(
    req: PlanRequest,
    instances: list[InstanceView],
    config: PolicyConfig,
    wan_mbps: float | None = None,
    wan_backlog_bytes: float = 0.0,
) -> Decision:
    if req.ttft_slo_ms is not None:
        config = dataclasses.replace(config, ttft_slo_ms=req.ttft_slo_ms)
    wan = Link(wan_mbps or config.wan_mbps, config.wan_delay_ms)
    line = max(wan_backlog_bytes, 0.0) if config.line_backlog else 0.0
    prefill = cheapest(instances, Role.PREFILL, req, config)
    decoders, missing = {}, {}
    for role in (Role.RLD, Role.MD):
        try:
            decoders[role] = cheapest(instances, role, req, config)
        except NoCapacity as e:
            missing[role] = e
    md = decoders.get(Role.MD)
    wire, wire_reason = choose_wire(req, prefill, md, config, wan, line)
    priors = with_wire(config, wire)
    suffix = choose_suffix(req, prefill, md, priors, wan, line) if md is not None else Suffix()
    computes = {Role.MD: suffix.tokens > 0, Role.RLD: False}  # whether it computes what it lacks
    ttft = {
        p: estimate_ttft(p, req.prompt_len, prefill, decoders[role], priors, wan, line, computes[role]).total_ms
        for p, role in ((Pipeline.P_MD, Role.MD), (Pipeline.P_RLD_MD, Role.RLD))
        if role in decoders
    }
    uncached = uncached_tokens(req, instances)
    rld = decoders.get(Role.RLD)
    md_alive = not (isinstance(missing.get(Role.MD), NoCapacity) and not isinstance(missing.get(Role.MD), Saturated))
    backlog = expected_backlog(req, rld, ttft, config) if rld is not None else 0
    pipeline, reason = choose_pipeline(req, rld, md_alive, ttft, uncached, config, backlog)
    if reason == "no-relay-alive" and isinstance(missing.get(Role.RLD), Saturated):
        reason = "rld-full"
    roles = ROLES_OF[pipeline]
    for role in roles[1:]:
        if role not in decoders:
            raise missing[role]
    picked = {Role.PREFILL: prefill} | {role: decoders[role] for role in roles[1:]}
    handoff, handoff_reason = Handoff.NONE, ""
    if pipeline == Pipeline.P_RLD_MD:
        handoff, handoff_reason = choose_handoff(req, decoders[Role.RLD], backlog, config)
    elif reason != "relay-finishes":
        backlog = 0  # recorded only where it counted: the handoff, or the relay finishing alone
    hits = {role: min(i.hit_tokens, req.prompt_len) for role, i in picked.items() if role != Role.PREFILL}
    if Role.MD not in picked:
        suffix = Suffix()
    starts = hits | ({Role.MD: req.prompt_len} if suffix.tokens else {})
    estimates = PlanEstimates(
        ttft_ms=ttft,
        wan_mbps=wan.mbps,
        uncached_tokens=uncached,
        backlog_tokens=backlog,
        rld_busy=rld_busy(rld) if rld else 0,
        wan_backlog_bytes=line,
        ttft_slo_ms=config.ttft_slo_ms,
        md_push_ms=suffix.push_ms,
        md_extend_ms=suffix.extend_ms,
    )
    return Decision(
        pipeline=pipeline,
        handoff=handoff,
        **{role: i.id for role, i in picked.items()},
        md_cached_tokens=hits.get(Role.MD, 0),
        starts=starts,
        reason=reason,
        handoff_reason=handoff_reason,
        chunk_tokens=config.catchup_chunk if handoff == Handoff.CATCHUP else 0,
        estimates=estimates,
        kv_wire=wire if Role.MD in picked else WireFormat.NATIVE,
        kv_wire_reason=wire_reason if Role.MD in picked else "",
        md_computes_suffix=suffix.tokens,
        md_suffix_reason=suffix.reason,
    )
