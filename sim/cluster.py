"""One simulated cluster in one mode: instances, links, and the scheduler's own policy.

Lifecycle of a request (`SimCluster.run`):
1. Sent at its arrival time, or, for a later turn of a session, when the turn before it has
   finished (as `pdd bench`'s open-loop runner does).
2. Planned by `choose_plan` — the scheduler's function itself, imported, never copied — on
   views of every instance (sim/views.py): prefix hits from the block index, running /
   waiting / pending counts and free KV blocks — live, or from heartbeats `heartbeat_s` apart
   plus the dispatches since, as the real registry gives them — optionally the measured step
   times and prefill throughput the real heartbeat does not carry, the WAN bandwidth the
   estimator has learnt from finished transfers, and the line's backlog (`Serving.backlog`,
   the scheduler's own `WanBacklog`, kept as the service keeps it).
3. Served by `sim.pipeline.Serving` (prefill, KV, decode, handoff).
4. Finished: its later turns are released. A request no instance can take fails at once
   (`NoCapacity`, the gateway's 503).
Differences from the real scheduler: unless a config's `views:` asks for heartbeats, views are
exact and current; the control plane's cost is one `request_overhead_ms` per request
(sim/host.py), paid between sending and planning.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from benchmarks.modes import mode as mode_of
from services.scheduler.estimates import BandwidthEstimator, InstanceView
from services.scheduler.policy import NoCapacity, PlanRequest, choose_plan
from shared.pipelines import Role
from sim.cache import PrefixIndex
from sim.config import SimConfig, policy_config
from sim.decoder import DecodeInstance
from sim.events import EventLoop
from sim.host import SharedHost
from sim.link import DirectLink, SharedLink
from sim.pipeline import Serving
from sim.prefill import PrefillInstance
from sim.request import RequestRun, SimRequest
from sim.views import HeartbeatViews

POLICY = choose_plan  # the scheduler's function object (tests assert it is the same one)


class SimCluster:
    def __init__(self, cfg: SimConfig, mode: str, block_tokens: int, horizon_ms: float, seed: int = 0) -> None:
        self.cfg, self.mode = cfg, mode
        self.loop = EventLoop()
        self.index = PrefixIndex()
        self.policy = policy_config(cfg, mode)
        self.host = SharedHost(cfg.host_spec())
        self.prefills: list[PrefillInstance] = []
        self.decoders: list[DecodeInstance] = []
        for g in cfg.groups(mode):
            for k in range(g.count):
                iid = f"{g.role}-{k}"
                if g.role == Role.PREFILL:
                    self.prefills.append(
                        PrefillInstance(iid, g.dc, g.profile, self.loop, self.index, block_tokens, self.host)
                    )
                else:
                    self.decoders.append(
                        DecodeInstance(
                            iid, g.role, g.dc, g.profile, self.loop, self.index, block_tokens, self.host, g.prefix_cache
                        )
                    )
        w = cfg.wan
        proxy = self.host.spec.wan_proxy_cores  # the WAN emulator's CPU on a shared host
        on_active = (lambda busy: self.host.set_busy("wan", busy, proxy)) if proxy else None
        self.wan = SharedLink(
            self.loop,
            cfg.bandwidth(),
            float(w.get("delay_ms", 0.0)),
            float(w.get("jitter_ms", 0.0)),
            horizon_ms=horizon_ms,
            seed=seed,
            on_active=on_active,
        )
        self.local = DirectLink(self.loop, float(cfg.local["mbps"]), float(cfg.local.get("delay_ms", 0.0)))
        self.estimator = BandwidthEstimator(self.policy.wan_mbps, float(w.get("delay_ms", 0.0)))
        instances = {i.id: i for i in [*self.prefills, *self.decoders]}
        self.pipeline = Serving(
            self.loop,
            instances,
            self.wan,
            self.local,
            self.estimator,
            self.prefills[0].profile.kv_bytes_per_token,
            int(cfg.handoff["chunk_tokens"]),
            int(cfg.handoff["final_tokens"]),
            self._finished,
            warm_md_cache=cfg.warm_md_cache,
            control_delay_ms=cfg.control_delay_ms,
            connect_ms=cfg.connect_ms,
            first_token_from_prefill=mode_of(mode).first_token == Role.PREFILL,
        )
        gateway_dc = self.prefills[0].dc  # the gateway and scheduler sit with prefill (datacenter A)
        for dec in self.decoders:
            dec.to_client_ms = cfg.control_delay_ms if dec.dc != gateway_dc else 0.0
        self.runs: dict[str, RequestRun] = {}
        self._waiters: dict[str, list[str]] = defaultdict(list)
        self.samples: list[dict] = []  # periodic load figures (see `sample_every`)
        self.registry = HeartbeatViews(self.loop, [*self.prefills, *self.decoders], cfg.view_spec(), seed)

    # -- 2. what the policy sees ---------------------------------------------------------------
    def views(self, req: SimRequest) -> list[InstanceView]:
        hits = self.index.leading_hits(req.blocks)
        return self.registry.views({iid: req.hit_tokens(n) for iid, n in hits.items()})

    # -- 1, 3, 4. the request's life --------------------------------------------------------------
    def run(self, requests: list[SimRequest], progress: bool = False, sample_every_ms: float = 0.0) -> list[RequestRun]:
        self.runs = {r.request_id: RequestRun(r) for r in requests}
        for r in requests:
            if r.depends_on in self.runs:
                self._waiters[r.depends_on].append(r.request_id)
            else:
                self.loop.at(r.arrival_ms, self._send, self.runs[r.request_id])
        self.registry.start()
        if sample_every_ms > 0:
            self.loop.at(0.0, self._sample, sample_every_ms, requests[-1].arrival_ms if requests else 0.0)
        report = (
            (lambda t: print(f"\r  sim {self.mode}: t={t / 1000:,.0f}s", end="", file=sys.stderr)) if progress else None
        )
        self.loop.run(progress=report)
        if progress:
            print(file=sys.stderr)
        return list(self.runs.values())

    def _send(self, run: RequestRun) -> None:
        run.sent_ms = self.loop.now
        overhead = self.host.spec.request_overhead_ms
        if overhead > 0:  # gateway, scheduler, Redis, NATS, SSE: once per request, before the plan
            self.loop.after(overhead, self._plan, run)
        else:
            self._plan(run)

    def _plan(self, run: RequestRun) -> None:
        req = run.req
        try:
            plan_req = PlanRequest(req.request_id, req.prompt_len, req.output_len)
            views, wan_mbps = self.views(req), self.estimator.mbps(self.loop.now / 1000.0)
            backlog = self.pipeline.backlog.total(self.loop.now / 1000.0)
            d = POLICY(plan_req, views, self.policy, wan_mbps=wan_mbps, wan_backlog_bytes=backlog)
        except NoCapacity as e:
            run.marks["failed"] = self.loop.now
            run.reason = f"no capacity: {e}"
            self._release(run)
            return
        self.registry.dispatch(d.instance_ids)
        self.pipeline.start(run, d)

    def _finished(self, run: RequestRun) -> None:
        self._release(run)

    def _release(self, run: RequestRun) -> None:
        seen = max(self.loop.now, run.token_times[-1]) if run.token_times else self.loop.now  # by the client
        for rid in self._waiters.pop(run.req.request_id, ()):
            nxt = self.runs[rid]
            self.loop.at(max(seen, nxt.req.arrival_ms), self._send, nxt)

    def _sample(self, every_ms: float, until_ms: float) -> None:
        rld = [d for d in self.decoders if d.role == Role.RLD]
        self.samples.append(
            {
                "t_s": self.loop.now / 1000.0,
                "rld_busy": sum(len(d.running) + len(d.waiting) + d.pending for d in rld),
                "rld_waiting": sum(len(d.waiting) for d in rld),
                "rld_slots": sum(d.profile.max_running for d in rld),
                "wan_flows": self.wan.active,
                "wan_mbps": self.wan.mbps,
            }
        )
        if self.loop.now < until_ms:
            self.loop.after(every_ms, self._sample, every_ms, until_ms)
