"""Scheduler: turns a submitted request into a plan and dispatches it.

Several schedulers may run (control_plane.schedulers), active-active: submissions come through
one NATS queue group, so each is planned by one of them; the plans live in Redis, so a
resubmission gets the same plan from any of them; the line's backlog is told to all of them on
the bus; the registry and the prefix index are Redis's. A scheduler holds nothing another
needs: killing one loses only the submissions it was planning (the gateway submits them again).

Lifecycle of a request here:
1. `Submit` from the gateway (request-reply). A request id seen before gets its earlier plan
   back (idempotent: the gateway may retry after a timeout, through another scheduler): the
   first scheduler to claim `pdd:plan:<id>` plans it, any other waits for its plan there (or
   takes the claim over once the claimer's presence expired: it died while planning).
2. Alive instances and their load are read from Redis; `policy.choose_plan` decides the
   pipeline and the instances (pure function, no I/O), counting the line's backlog: the KV
   this scheduler dispatched across the WAN that has not landed (`WanBacklog`: in when a plan
   sending KV across is dispatched, out when the decoder's `WanSample` for that request says
   it landed, when the request is aborted or its dispatch failed, or `timeouts.request_s`
   after its dispatch at the latest). Each scheduler tells the others what it adds and settles
   (`LineBacklog`); the samples and aborts reach every scheduler anyway.
3. Every stage at once, in no order: each decoder gets a `DecodeTask`, prefill a `PrefillTask`
   with the KV targets (each decoder's advertised endpoint and a fresh transfer secret that only
   that decoder expects for this request). No round trip through the line comes before prefill
   starts; a push that reaches a decoder before its task waits there for the task. The plan
   goes back once every stage acked; its `dispatch_id` names this dispatch.
4. The plan, recorded in Redis before the dispatch (`pdd:request:<id>`, removed by the gateway
   at the end and by the scheduler when the request is aborted, after its dispatch if the abort
   came during it; an instance holding a request no longer recorded drops it), goes back to the
   gateway.
5. If any dispatch fails, the request is aborted everywhere (or, where a stage did not answer,
   this copy is dropped everywhere and the request planned again without it; main-decode silent
   behind a relay that took its task leaves the relay finishing it), its record removed, and the
   gateway gets an error plan: 503 when a role has no alive instance, 429 when every instance of a role
   is full (each stage holds at most max_running + max_waiting requests and refuses more:
   bounded queues).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import math
import secrets
import signal
import time
from collections import Counter
from collections.abc import Collection

from services.scheduler.estimates import BandwidthEstimator
from services.scheduler.inputs import Dispatched, Views, WanBacklog, cluster_policy_config, wan_kv_bytes
from services.scheduler.live_view import LiveView
from services.scheduler.policy import NoCapacity, PlanRequest, PolicyConfig, choose_plan
from services.scheduler.registrar import Registrar, Roster
from shared import failpoints, heap, subjects
from shared.bus import Bus, BusTimeout, NoResponders
from shared.config import ClusterConfig
from shared.messages import (
    Abort,
    Ack,
    ClusterStatus,
    DecodeTask,
    Drop,
    FinishOnRelay,
    Heartbeat,
    Inspect,
    InstanceInfo,
    KVTarget,
    Leave,
    LineBacklog,
    Plan,
    PrefillTask,
    Submit,
    WanSample,
)
from shared.model_info import link_wire, model_name
from shared.pipelines import Handoff, Pipeline, hands_off
from shared.prefix_hash import block_hashes, namespace_of
from shared.registry import PLANNING, Registry
from shared.security import Secrets
from shared.telemetry import Metrics

log = logging.getLogger(__name__)
MAX_PLANS = 10_000  # recent plans remembered for idempotent replies, whatever their age
QUEUE = "schedulers"  # the NATS queue group: one scheduler gets each submission
# a stage's task met "no responders": asked again every NO_RESPONDERS_RETRY_S for this long (a
# client moving to another server of the cluster reconnects within its 0.5 s wait, shared/bus.py)
NO_RESPONDERS_S = 1.5
NO_RESPONDERS_RETRY_S = 0.05


class DispatchError(Exception):
    status = 503


class Unreachable(DispatchError):
    """The instance did not answer at all: dead, with its heartbeat not yet expired."""

    def __init__(self, instance_id: str, message: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class Busy(DispatchError):
    """An instance refused for lack of room (its bounded queue is full): 429, not a fault."""

    status = 429


class Scheduler:
    def __init__(self, cfg: ClusterConfig, policy: PolicyConfig | None = None, name: str = "scheduler") -> None:
        self.cfg = cfg
        self.name = name  # one of control_plane.scheduler_names
        self.policy = policy or cluster_policy_config(cfg)
        self.wan = BandwidthEstimator(self.policy.wan_mbps, self.policy.wan_delay_ms)
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.view: LiveView | None = None  # the alive instances from the heartbeats (None: read Redis)
        # recent plans by request id, oldest first: a resubmission gets the same reply (idempotent);
        # kept 4 submit timeouts, at most MAX_PLANS (a cap alone grew memory for 10,000 plans)
        self.plans: dict[str, tuple[float, Plan]] = {}
        self.plan_memory_s = 4 * 3 * cfg.timeouts.control_s
        self.claim_s = 4 * cfg.timeouts.control_s  # how long a claim may stand unplanned (3 tries, then some)
        self.dispatched = Dispatched()
        self.views = Views()
        self.planning: dict[str, bool] = {}  # request id -> aborted while it was being planned
        self.backlog = WanBacklog(max_age_s=cfg.timeouts.request_s)  # KV on the line, by request
        self.unreachable: dict[str, float] = {}  # instance -> when it failed to answer (wall clock)
        self.metrics = Metrics(model_name(cfg.model), "scheduler")
        self.wan_estimate = self.metrics.gauge("pdd:wan_bandwidth_estimate_mbps", "The scheduler's WAN estimate")
        self.wan_backlog = self.metrics.gauge("pdd:wan_backlog_bytes", "KV dispatched across the WAN, not landed yet")
        self.planned = self.metrics.counter("pdd:plans", "Plans made, by pipeline and reason", ("pipeline", "reason"))
        self.plan_counts: Counter[str] = Counter()
        secrets = Secrets.of(cfg)
        self.index_key = secrets.index_key if secrets else b""  # the instances key their block hashes alike
        self.refused = self.metrics.counter("pdd:plan_failures", "Requests not planned, by HTTP status", ("status",))
        self._tasks: set[asyncio.Task] = set()
        self._unshared: dict[str, str] = {}  # request id -> its plan (base64), not in Redis yet
        self._sharing: asyncio.Task | None = None
        self.last_request = ""  # the request planned last (`pdd status`)

    async def run(self) -> None:
        failpoints.configure(self.name, "scheduler")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        secrets = Secrets.of(self.cfg)
        self.bus = await Bus.connect(self.cfg.nats_url_for(self.cfg.control_dc), self.name, "scheduler", secrets)
        self.registry = Registry.of(self.cfg)
        cfg = self.cfg
        registrar = Registrar(
            self.registry,
            request_ttl_s=cfg.timeouts.request_s,
            control_dc=cfg.control_dc,
            line_delay_s=(cfg.wan.delay_ms + cfg.wan.jitter_ms) / 1000 if cfg.wan.enabled else 0.0,
            heartbeat_s=cfg.heartbeat_s,
            roster=Roster.of(cfg),
        )
        await registrar.serve(self.bus)
        # the view listens on a connection of its own: NATS lets a client answer a request it got
        # only once (allow_responses), and a second delivery on the registrar's connection had the
        # server refuse the registrar's replies to the heartbeats
        self.view = LiveView(registrar.liveness, roster=registrar.roster)
        url = self.cfg.nats_url_for(self.cfg.control_dc)
        self.view_bus = await Bus.connect(url, f"{self.name}-view", "scheduler", secrets, on_link=self.view.link)
        await self.view_bus.subscribe(subjects.HEARTBEATS, Heartbeat, self.view.heard, by_reporter=True)
        await self.view_bus.subscribe(subjects.LEAVES, Leave, self.view.left, by_reporter=True)
        await self.view_bus.sync()
        self.wan_estimate.set(self.wan.mbps(time.monotonic()))
        self.metrics.serve(self.cfg.host, self.cfg.scheduler_metrics_port(self.name))
        await self.serve()
        heap.settle(self.metrics)
        presence = asyncio.create_task(
            self.registry.announce("scheduler", self.name, self.cfg.control_dc, self.cfg.heartbeat_s, self._figures)
        )
        log.info("%s ready", self.name)
        await stop.wait()
        presence.cancel()
        await self.view_bus.close()
        await self.bus.close()
        await self.registry.r.aclose()

    async def serve(self) -> None:
        """Answer on `self.bus`: submissions and status (one scheduler of the queue group each),
        the decoders' WAN samples, aborts and the other schedulers' backlog (every scheduler)."""
        await self.bus.serve(subjects.SUBMIT, Submit, self.on_submit, queue=QUEUE)
        await self.bus.serve(subjects.STATUS, Inspect, self.on_status, queue=QUEUE)
        await self.bus.serve(subjects.WAN_SAMPLES, WanSample, self.on_wan_sample, by_reporter=True)
        await self.bus.serve(subjects.ABORT, Abort, self.on_abort)
        await self.bus.serve(subjects.LINE_BACKLOG, LineBacklog, self.on_line_backlog)

    async def on_line_backlog(self, msg: LineBacklog) -> None:
        """Another scheduler dispatched KV across the line (or settled what it had)."""
        if msg.scheduler != self.name:
            self.backlog.add(msg.request_id, msg.nbytes, time.monotonic(), to=msg.to)
            self.wan_backlog.set(self.backlog.total(time.monotonic()))

    async def on_wan_sample(self, sample: WanSample, reporter: str | None = None) -> None:
        """Only the decoder a request's KV was dispatched to across the line reports its transfer
        (one instance's made-up samples would set the estimate every plan reads)."""
        to = self.backlog.receiver(sample.request_id)  # None: no KV of it is on the line
        sender_ok = to is not None and (reporter is None or reporter == to)  # None: a call in this process
        if not sender_ok or sample.nbytes <= 0 or not 0 < sample.seconds < math.inf:
            log.warning("%s: WAN sample from %s for %r refused", self.name, reporter, sample.request_id)
            return
        self.wan.add(sample.nbytes, sample.seconds, time.monotonic())
        self.wan_estimate.set(self.wan.mbps(time.monotonic()))
        self._settle(sample.request_id)

    async def on_abort(self, msg: Abort) -> None:
        if msg.keep_kv:  # finished on the relay: md's KV still crosses, settled when it lands
            return
        self._settle(msg.request_id)  # an aborted request's KV stops crossing (the decoder cancels it)
        if msg.request_id in self.planning:  # its record may not be written yet: removed after the dispatch
            self.planning[msg.request_id] = True
        else:  # the gateway removes it too, but may have done so before a late dispatch wrote it
            await self._unrecord(msg.request_id)

    def _settle(self, request_id: str, tell: bool = False) -> None:
        """Its KV is off the line. `tell`: the other schedulers hear of it only from here (its
        dispatch failed), not from a sample or an abort that reached them too."""
        if request_id and self.backlog.settle(request_id):
            self.wan_backlog.set(self.backlog.total(time.monotonic()))
            if tell:
                self._tell_backlog(request_id, 0)

    def _tell_backlog(self, request_id: str, nbytes: int, to: str = "") -> None:
        if self.cfg.control_plane.schedulers > 1:
            msg = LineBacklog(request_id, nbytes, self.name, to=to)
            self._spawn(self.bus.publish(subjects.LINE_BACKLOG, msg))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_status(self, _: Inspect) -> ClusterStatus:
        return ClusterStatus(
            instances=await self.registry.alive(),
            wan_estimate_mbps=self.wan.mbps(time.monotonic()),
            plans=dict(self.plan_counts),
            now=time.time(),
            scheduler=self.name,
            control=await self.registry.processes(),
        )

    def _figures(self) -> dict[str, str]:
        return {"planned": str(sum(self.plan_counts.values())), "last_request": self.last_request}

    async def on_submit(self, sub: Submit) -> Plan | None:
        if sub.request_id in self.plans:
            return self.plans[sub.request_id][1]
        t0 = time.monotonic()
        listed = await self._listed()
        hashes = self._hashes(sub)
        earlier, hits = await self._claim(sub.request_id, [i.id for i in listed], hashes)
        if earlier is not None:
            return earlier
        if failpoints.hit("scheduler.submit"):  # claimed, never planned nor answered (tests)
            return None
        self.planning[sub.request_id] = False
        try:
            plan = await self._plan_around_the_dead(sub, listed, hits)
            if self.planning[sub.request_id]:  # the gateway gave up on it meanwhile; the stages dropped it
                self._settle(sub.request_id, tell=True)  # counted on the line after the abort settled it
                await self._unrecord(sub.request_id)
                plan = Plan(sub.request_id, error="aborted while it was being dispatched", status=503)
        except NoCapacity as e:  # Saturated: 429
            plan = Plan(sub.request_id, error=str(e), status=e.status)
        except DispatchError as e:  # Busy: 429
            await self.bus.publish(subjects.ABORT, Abort(sub.request_id, reason=f"dispatch failed: {e}"))
            plan = Plan(sub.request_id, error=str(e), status=e.status)
        except Exception as e:  # e.g. Redis unreachable: say so now rather than let the gateway time out
            log.warning("planning %s failed: %s", sub.request_id, e)
            await self.bus.publish(subjects.ABORT, Abort(sub.request_id, reason=f"planning failed: {e}"))
            return Plan(sub.request_id, error=f"scheduler could not plan the request: {e}", status=503)
        finally:
            self.planning.pop(sub.request_id, None)
        plan.queue_ms = (time.monotonic() - t0) * 1000
        plan.scheduler = self.name
        if plan.error:
            self.refused.labels(status=str(plan.status)).inc()
        else:
            self.planned.labels(pipeline=plan.pipeline, reason=plan.reason).inc()
            self.plan_counts[plan.pipeline] += 1
            self.last_request = plan.request_id
            log.info(
                "%s: %s (%s) on %s",
                sub.request_id,
                plan.pipeline,
                plan.reason,
                ", ".join(i for i in (plan.prefill, plan.rld, plan.md) if i),
            )
        self._remember(plan)
        self._share(plan)
        return plan

    async def _claim(
        self, request_id: str, instance_ids: list[str], hashes: list[str]
    ) -> tuple[Plan | None, dict[str, int] | None]:
        """(None, the prefix hits of `instance_ids`, looked up in the claim's round trip) once this
        scheduler may plan the request; else (the plan another made of it, or an error plan when
        the other is still at it past `claim_s`, None). A claim whose scheduler died (its presence
        expired) is taken over. Without Redis, the request is planned here (hits None: not
        looked up)."""
        deadline = time.monotonic() + self.claim_s
        wait_s = 0.005
        while True:
            try:
                held, hits = await self.registry.claim_plan(request_id, self.name, self.claim_s, instance_ids, hashes)
                if held is None:
                    return None, {iid: n * self.cfg.block_size for iid, n in hits.items()}
                if not held.startswith(PLANNING):
                    return Plan.decode(base64.b64decode(held)), None
                owner = held[len(PLANNING) :]
                mine_before = owner == self.name and request_id not in self.planning  # this name's previous life
                if mine_before or (owner != self.name and not await self.registry.process_alive("scheduler", owner)):
                    log.warning("%s: %s died planning %s; planning it here", self.name, owner, request_id)
                    await self.registry.release_claim(request_id, held)
                    continue
            except Exception as e:  # Redis failing over: planning twice beats not planning
                log.warning("%s: plan claim of %s failed (%s); planning it here", self.name, request_id, e)
                return None, None
            if time.monotonic() > deadline:
                return Plan(request_id, error=f"{owner} is still planning it", status=503), None
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, 0.1)

    def _share(self, plan: Plan) -> None:
        """The plan, for a resubmission through any scheduler (as long as this one remembers it),
        written after the reply, the plans of a burst in one round trip. Until it is written a
        resubmission elsewhere finds this scheduler's claim and waits for it (`_claim`)."""
        self._unshared[plan.request_id] = base64.b64encode(plan.encode()).decode()
        if self._sharing is None or self._sharing.done():
            self._sharing = asyncio.create_task(self._share_all())

    async def _share_all(self) -> None:
        while self._unshared:
            plans, self._unshared = self._unshared, {}
            try:
                await self.registry.save_plans(plans, self.plan_memory_s)
            except Exception as e:  # their claims expire: a resubmission is planned afresh
                log.warning("%s: %d plans not shared: %s", self.name, len(plans), e)

    async def _plan_around_the_dead(
        self, sub: Submit, listed: list[InstanceInfo], hits: dict[str, int] | None, tries: int = 3
    ) -> Plan:
        """An instance killed a moment ago is still in the registry until its heartbeat expires:
        one that does not answer its task is left out and the request planned again. It stays
        out of this request's re-plans even if it heartbeats meanwhile: a prefill was told to drop
        the request and would refuse it now, and any instance that just missed an ack may miss
        the next. `listed`, `hits`: the instances and prefix hits the claim saw, for the first plan
        (hits None: look them up); a re-plan reads both again."""
        failed: set[str] = set()
        for attempt in range(tries):
            try:
                first = attempt == 0
                return await self._plan_and_dispatch(sub, failed, listed if first else None, hits if first else None)
            except Unreachable as e:
                log.warning("%s: %s; planning %s again without it", e.instance_id, e, sub.request_id)
                self.unreachable[e.instance_id] = time.time()
                failed.add(e.instance_id)
                if attempt == tries - 1:
                    raise

    def _answering(self, i: InstanceInfo) -> bool:
        """False for an instance that failed to answer and has not heartbeated since."""
        failed_at = self.unreachable.get(i.id)
        if failed_at is not None and i.updated_at > failed_at:
            del self.unreachable[i.id]  # it is back (restarted)
            return True
        return failed_at is None

    async def _listed(self) -> list[InstanceInfo]:
        """The instances alive: the live view's (heartbeats heard), else the registry's."""
        listed = self.view.alive() if self.view is not None else None
        return listed if listed is not None else await self.registry.alive()

    async def _plan_and_dispatch(
        self,
        sub: Submit,
        failed: Collection[str] = (),
        listed: list[InstanceInfo] | None = None,
        hits: dict[str, int] | None = None,
    ) -> Plan:
        listed = listed if listed is not None else await self._listed()
        if self.unreachable or failed:
            listed = [i for i in listed if self._answering(i) and i.id not in failed]
        alive = {i.id: i for i in listed}
        if hits is None:
            hits = await self._prefix_hits(list(alive), self._hashes(sub))
        views = self.views.of(alive.values(), hits, self.dispatched)
        req = PlanRequest(
            sub.request_id,
            prompt_len=len(sub.prompt_ids),
            max_tokens=sub.sampling.max_tokens,
            pipeline=sub.pipeline,
            handoff=sub.handoff,
            avoid=frozenset(sub.avoid),
            kv_wire=sub.kv_wire,
            ttft_slo_ms=sub.ttft_slo_ms,
        )
        now = time.monotonic()
        d = choose_plan(req, views, self.policy, wan_mbps=self.wan.mbps(now), wan_backlog_bytes=self.backlog.total(now))
        plan = Plan(
            sub.request_id,
            pipeline=d.pipeline,
            handoff=d.handoff,
            prefill=d.prefill,
            rld=d.rld,
            md=d.md,
            md_cached_tokens=d.md_cached_tokens,
            reason=d.reason,
            handoff_reason=d.handoff_reason,
            chunk_tokens=d.chunk_tokens,
            estimates=d.estimates,
            kv_wire=d.kv_wire,
            kv_wire_reason=d.kv_wire_reason,
            md_computes_suffix=d.md_computes_suffix,
            md_suffix_reason=d.md_suffix_reason,
            dispatch_id=secrets.token_hex(8),
            stream_key=sub.stream_key,
        )
        decoders = [alive[i] for i in (plan.rld, plan.md) if i]
        for iid in d.instance_ids:  # before any await: a request planned meanwhile must see these
            self.dispatched.add(iid, time.time())
        prefill = alive[plan.prefill]
        targets = [
            _target(prefill, inst, d.starts[inst.role], plan.kv_wire, self.cfg.scheduler.kv_wire_in_dc)
            for inst in decoders
        ]
        crossing = [t for t in targets if t.wan]  # main-decode computing its suffix (start: the prompt's end) adds none
        on_line = sum(wan_kv_bytes(len(sub.prompt_ids) - t.start, t.wire, self.policy) for t in crossing)
        to = crossing[0].instance_id if crossing else ""
        self.backlog.add(sub.request_id, on_line, now, to=to)  # before any await, as the dispatches above
        self.wan_backlog.set(self.backlog.total(now))
        if on_line:
            self._tell_backlog(sub.request_id, on_line, to)
        try:
            return await self._dispatch(sub, plan, prefill, decoders, targets)
        except BaseException:  # nothing of it will cross (or, re-planned, the next plan counts it)
            self._settle(sub.request_id, tell=True)
            raise

    async def _dispatch(
        self, sub: Submit, plan: Plan, prefill: InstanceInfo, decoders: list[InstanceInfo], targets: list[KVTarget]
    ) -> Plan:
        """Every stage's task at once: prefill starts while main-decode's task and ack cross the
        line, not after (a push that reaches a decoder before its task waits for it there). A
        refusal or a silence is handled when it shows, with the outcomes it had one at a time: a
        busy stage fails the plan (429, and the request's abort frees the others); an unreachable
        one has this copy dropped everywhere and the request planned again, except main-decode
        behind a relay that took its task: the relay finishes the request, as when main-decode's
        KV cannot be delivered (prefill may be computing or pushing already)."""
        await self._record(plan)  # before any stage holds it: a holder of an unrecorded request drops it
        task = PrefillTask(
            sub.request_id,
            prompt_ids=sub.prompt_ids,
            sampling=sub.sampling,
            targets=targets,
            plan=plan,
            cache_salt=sub.cache_salt,
        )
        try:
            acks = await asyncio.gather(
                *(self._dispatch_decode(sub, plan, inst, t) for inst, t in zip(decoders, targets)),
                self._expect_ack(subjects.prefill_task(prefill.id), task, prefill.id),
                return_exceptions=True,
            )
            stages = [*decoders, prefill]
            failed = {inst.id: e for inst, e in zip(stages, acks) if isinstance(e, BaseException)}
            if failed.keys() == {plan.md} and isinstance(failed[plan.md], Unreachable) and hands_off(plan.pipeline):
                md_target = next(t for t in targets if t.instance_id == plan.md)
                return await self._relay_finishes(plan, md_target, failed[plan.md])
            if failed:
                raise next(iter(failed.values()))
            return plan
        except BaseException as e:
            if isinstance(e, Unreachable):  # planned again: this copy's stages let go (not an abort, which sticks)
                await self._drop_copy(sub.request_id, prefill, decoders, targets)
            await self._unrecord(plan.request_id)  # a re-plan records itself again; an error plan leaves nothing
            raise

    async def _relay_finishes(self, plan: Plan, md_target: KVTarget, silence: Unreachable) -> Plan:
        """The plan without main-decode: the relay is told to finish the request alone and
        main-decode to drop its copy (should it wake), and the gateway gets a `p-rld` plan."""
        rid, md = plan.request_id, plan.md
        log.warning("%s: %s; the relay %s finishes %s", md, silence, plan.rld, rid)
        self.unreachable[md] = time.time()
        reason = f"{md} did not answer its task"
        await self.bus.publish(subjects.finish_on_relay(plan.rld), FinishOnRelay(rid, reason=reason))
        dropped = Drop(rid, reason=reason, transfer_secret=md_target.transfer_secret)
        await self.bus.publish(subjects.decode_drop(md), dropped)
        self._settle(rid, tell=True)  # its KV will not cross
        alone = dataclasses.replace(
            plan,
            pipeline=Pipeline.P_RLD,
            handoff=Handoff.NONE,
            md="",
            md_cached_tokens=0,
            md_computes_suffix=0,
            md_suffix_reason="",
            reason=f"{plan.reason}; {reason}: the relay finishes it",
        )
        await self._record(alone)
        return alone

    async def _drop_copy(
        self, rid: str, prefill: InstanceInfo, decoders: list[InstanceInfo], targets: list[KVTarget]
    ) -> None:
        """The re-plan may pick the same instances: each drop names this copy by its secrets, and
        a stage holding the re-plan's copy keeps it. Prefill may have taken its task (slow, not
        dead, or sent beside a decoder that was): its late first token and push must not end the
        new plan."""
        for inst, target in zip(decoders, targets):
            await self.bus.publish(
                subjects.decode_drop(inst.id), Drop(rid, reason="re-planned", transfer_secret=target.transfer_secret)
            )
        dropped = Drop(rid, reason="re-planned", transfer_secret=targets[0].transfer_secret)
        await self.bus.publish(subjects.prefill_drop(prefill.id), dropped)

    async def _dispatch_decode(self, sub: Submit, plan: Plan, inst: InstanceInfo, target: KVTarget) -> None:
        task = DecodeTask(
            sub.request_id,
            prompt_ids=sub.prompt_ids,
            sampling=sub.sampling,
            plan=plan,
            kv_start=target.start,
            transfer_secret=target.transfer_secret,
            cache_salt=sub.cache_salt,
        )
        await self._expect_ack(subjects.decode_task(inst.id), task, inst.id)

    def _hashes(self, sub: Submit) -> list[str]:
        """The prompt's block hashes, as its instances name them in the index."""
        return block_hashes(
            sub.prompt_ids, self.cfg.block_size, namespace_of(self.cfg.model, sub.cache_salt), key=self.index_key
        )

    async def _prefix_hits(self, instance_ids: list[str], hashes: list[str]) -> dict[str, int]:
        """Prefix tokens each instance holds (those holding none are absent), from the Redis index
        alone (one round trip)."""
        try:
            blocks = await self.registry.prefix_blocks(instance_ids, hashes)
        except Exception as e:  # no index: plan as if nothing were cached (correct, just slower)
            log.warning("prefix lookup failed: %s", e)
            return {}
        return {iid: n * self.cfg.block_size for iid, n in blocks.items()}

    async def _expect_ack(self, subject: str, msg, instance_id: str) -> None:
        """The stage's ack. "No responders" is asked again for `NO_RESPONDERS_S`: the instance may be
        moving to another NATS server of its site (one died), and a task nobody took is safe to send
        again; only then is it unreachable (and left out of the re-plan and of the plans that
        follow until it heartbeats: one NATS server's death 503ed every request for a moment)."""
        deadline = time.monotonic() + min(NO_RESPONDERS_S, self.cfg.timeouts.control_s)
        while True:
            try:
                ack = await self.bus.request(subject, msg, Ack, self.cfg.timeouts.control_s)
                break
            except NoResponders as e:
                if time.monotonic() >= deadline:
                    raise Unreachable(instance_id, f"{instance_id} did not answer: {e}") from None
                await asyncio.sleep(NO_RESPONDERS_RETRY_S)
            except BusTimeout as e:
                raise Unreachable(instance_id, f"{instance_id} did not answer: {e}") from None
        if not ack.ok:
            raise (Busy if ack.busy else DispatchError)(f"{instance_id} refused: {ack.error}")

    async def _record(self, plan: Plan) -> None:
        """Every holder's heartbeat checks the record: one never written would have the request
        dropped mid-stream, so a request that cannot be recorded is not dispatched (503)."""
        fields = {"pipeline": plan.pipeline, **plan.instances()}
        try:
            await self.registry.set_request(plan.request_id, fields, ttl_s=self.cfg.timeouts.request_s)
        except Exception as e:
            raise DispatchError(f"could not record the request: {e}") from None

    async def _unrecord(self, request_id: str) -> None:
        """Remove a request's record: its dispatch failed (no one else would: a migrating gateway
        retries under a new attempt id and forgets only the last one), or it was aborted."""
        try:
            await self.registry.delete_request(request_id)
        except Exception as e:  # it expires after timeouts.request_s
            log.warning("could not delete the record of %s: %s", request_id, e)

    def _remember(self, plan: Plan) -> None:
        now = time.monotonic()
        self.plans.pop(plan.request_id, None)
        self.plans[plan.request_id] = (now, plan)
        while self.plans:
            oldest, (at, _) = next(iter(self.plans.items()))
            if len(self.plans) <= MAX_PLANS and now - at <= self.plan_memory_s:
                break
            del self.plans[oldest]


def _target(prefill: InstanceInfo, decoder: InstanceInfo, start: int, wan_wire: str, local_wire: str) -> KVTarget:
    """Where prefill pushes a decoder's KV (its advertised endpoint: across the line when it is
    in the other site), with a fresh secret only that decoder expects for this request, and the
    wire format of that link (native KV into a narrower pool travels narrowed: `link_wire`)."""
    wan = decoder.dc != prefill.dc
    return KVTarget(
        decoder.id,
        role=decoder.role,
        host=decoder.kv_host,
        port=decoder.kv_port,
        start=start,
        transfer_secret=secrets.token_hex(16),
        wan=wan,
        wire=link_wire(wan_wire if wan else local_wire, prefill.dtype, decoder.dtype),
    )
