"""The line's backlog: the KV the scheduler dispatched across the WAN that has not landed.

`WanBacklog` on its own, then the scheduler service keeping it, driven on the in-memory bus
(tests/fakes.py) with a registry stand-in and instances that only ack their tasks: in when a plan
whose KV crosses is dispatched, out on the decoder's `WanSample` for that request, on an abort,
or when the dispatch failed; the next plan counts what is still on the line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import msgpack

from services.scheduler.inputs import WanBacklog, wan_kv_bytes
from services.scheduler.policy import PolicyConfig
from services.scheduler.service import Scheduler
from shared import subjects
from shared.config import config_from_dict
from shared.messages import Abort, Ack, DecodeTask, InstanceInfo, Plan, PrefillTask, Sampling, Submit, WanSample
from tests.fakes import InMemoryNats

WIRES = {"native": 46_080, "bf16": 23_040, "fp8": 12_240, "int8": 12_240}


# -- the ledger -----------------------------------------------------------------------------
def test_bytes_stay_on_the_line_until_settled():
    b = WanBacklog()
    b.add("a", 1000, at=0.0)
    b.add("b", 500, at=1.0)
    assert (b.total(now=2.0), len(b)) == (1500, 2)
    assert b.settle("a") == 1000 and b.total(now=2.0) == 500
    assert b.settle("a") == 0 and b.settle("nobody") == 0  # a second landing, an abort after it: no change
    assert b.settle("b") == 500 and (b.total(now=2.0), len(b)) == (0, 0)


def test_a_request_planned_again_is_counted_once_and_nothing_is_kept_for_no_bytes():
    b = WanBacklog()
    b.add("a", 1000, at=0.0)
    b.add("a", 300, at=1.0)  # re-planned: the new plan's bytes replace the old one's
    b.add("local", 0, at=1.0)  # nothing crosses: nothing held
    assert (b.total(now=1.0), len(b)) == (300, 1)


def test_entries_nothing_settles_expire_after_max_age():
    b = WanBacklog(max_age_s=10.0)
    for k in range(5):
        b.add(f"r{k}", 100, at=float(k))
    assert b.total(now=10.0) == 500  # r0 is exactly 10 s old: kept
    assert (b.total(now=12.5), len(b)) == (200, 2)  # r0, r1 and r2 are over 10 s old
    assert (b.total(now=100.0), len(b)) == (0, 0)


def test_wan_bytes_are_the_chosen_wires():
    cfg = PolicyConfig(wire_bytes_per_token=WIRES)
    assert [wan_kv_bytes(100, w, cfg) for w in ("native", "bf16", "int8")] == [4_608_000, 2_304_000, 1_224_000]
    assert wan_kv_bytes(-5, "native", cfg) == 0
    assert wan_kv_bytes(10, "native", PolicyConfig()) == 460_800  # no wire table: the native size


# -- the scheduler service keeping it -------------------------------------------------------
CONFIG = {
    "model": "tiny",
    "instances": [
        {"id": "prefill-0", "role": "prefill", "dc": "A"},
        {"id": "rld-0", "role": "rld", "dc": "A"},
        {"id": "md-0", "role": "md", "dc": "B"},
    ],
    "timeouts": {"request_s": 60, "control_s": 1},
}
INSTANCES = [
    InstanceInfo(i, i.split("-")[0], "B" if i.startswith("md") else "A", kv_host="127.0.0.1", kv_port=1)
    for i in ("prefill-0", "rld-0", "md-0")
]


class Registry:
    """The Redis registry's calls the scheduler makes: every instance alive, nothing cached."""

    async def alive(self) -> list[InstanceInfo]:
        return list(INSTANCES)

    async def prefix_blocks(self, instance_ids: list[str], hashes: list) -> dict[str, int]:
        return {}

    async def set_request(self, request_id: str, fields: dict, ttl_s: float) -> None: ...

    async def claim_plan(self, request_id: str, scheduler: str, ttl_s: float, ids: list, hashes: list) -> tuple:
        return None, {}  # this scheduler plans every request; nothing cached

    async def save_plans(self, encoded: dict, ttl_s: float) -> None: ...


class Cluster:
    """A scheduler on an in-memory bus; every instance acks its tasks (or refuses, when told)."""

    def __init__(self, **policy) -> None:
        self.nats = InMemoryNats()
        self.scheduler = Scheduler(
            config_from_dict(CONFIG), PolicyConfig(wire_bytes_per_token=WIRES, **{"line_backlog": True, **policy})
        )
        self.scheduler.bus, self.scheduler.registry = self.nats.client("scheduler"), Registry()
        self.bus = self.nats.client("gateway and decoders")
        self.refuse: set[str] = set()
        self.tasks: dict[str, PrefillTask | DecodeTask] = {}  # the last task each instance got

    async def start(self) -> Cluster:
        await self.scheduler.serve()
        for inst in INSTANCES:
            subject, kind = (
                (subjects.prefill_task(inst.id), PrefillTask)
                if inst.role == "prefill"
                else (subjects.decode_task(inst.id), DecodeTask)
            )
            await self.bus.serve(subject, kind, self._acker(inst.id))
        return self

    def _acker(self, instance_id: str):
        async def ack(task) -> Ack:
            self.tasks[instance_id] = task
            return Ack(task.request_id, ok=instance_id not in self.refuse, error="full", busy=True)

        return ack

    async def submit(self, rid: str, prompt_len: int, max_tokens: int = 600, **kw) -> Plan:
        sub = Submit(rid, list(range(prompt_len)), Sampling(max_tokens=max_tokens), **kw)
        return await self.bus.request(subjects.SUBMIT, sub, Plan, 5.0)

    async def publish(self, subject: str, msg) -> None:
        await self.bus.publish(subject, msg)
        await asyncio.gather(*list(self.nats.tasks))  # its handler has run

    @property
    def backlog(self) -> int:
        return self.scheduler.backlog.total(now=0.0)  # monotonic time is far past 0: nothing expires


async def test_a_plan_whose_kv_crosses_puts_its_bytes_on_the_line_until_they_land():
    c = await Cluster(ttft_slo_ms=1e9).start()  # every request meets the SLO via MD: p-md
    first = await c.submit("r1", 100)
    assert (first.pipeline, first.estimates.wan_backlog_bytes) == ("p-md", 0)
    assert c.backlog == 100 * 46_080
    second = await c.submit("r2", 50)
    assert second.estimates.wan_backlog_bytes == 100 * 46_080  # planned behind r1's KV
    assert c.backlog == 150 * 46_080
    await c.publish(subjects.wan_sample("md-0"), WanSample(100 * 46_080, 0.5, "r1"))  # r1's KV landed at MD
    assert c.backlog == 50 * 46_080 and len(c.scheduler.wan) == 1  # and it fed the bandwidth estimate
    await c.publish(subjects.ABORT, Abort("r2"))  # the client went: MD's receiver cancels the rest
    assert c.backlog == 0 and len(c.scheduler.backlog) == 0


async def test_the_backlog_counts_the_chosen_wires_bytes():
    c = await Cluster(ttft_slo_ms=1e9).start()
    plan = await c.submit("r1", 100, kv_wire="int8")
    assert (plan.kv_wire, c.backlog) == ("int8", 100 * 12_240)


async def test_native_kv_into_a_bfloat16_decoder_travels_as_bf16_and_is_counted_so(monkeypatch):
    """What main-decode's bf16 pool would round float32 KV to, sent as such: half the bytes on the
    line, the same bits in its pool (tests/runtime/test_kv_payload.py); the relay's fp32 pool
    still gets float32."""
    prefill, rld, md = INSTANCES
    monkeypatch.setattr(sys.modules[__name__], "INSTANCES", [prefill, rld, dataclasses.replace(md, dtype="bfloat16")])
    c = await Cluster(ttft_slo_ms=1, relay_finishes=False).start()  # the SLO is missed: p-rld-md
    plan = await c.submit("r1", 100)
    wires = {t.instance_id: t.wire for t in c.tasks["prefill-0"].targets}
    assert (plan.pipeline, plan.kv_wire) == ("p-rld-md", "native")
    assert wires == {"rld-0": "native", "md-0": "bf16"}
    assert c.backlog == 100 * 23_040


async def test_md_computing_its_suffix_is_told_so_and_puts_nothing_on_the_line(monkeypatch):
    """A 100-token prompt MD computes itself (at the 100,000 tok/s prior: 1 ms, against 37 ms of
    KV on the 1 Gbps line): the plan says so, MD's task and its KV target start at the prompt's
    end, not a block boundary, and no bytes join the backlog. MD in bfloat16 beside a float32
    prefill: pushed and counted, whatever the figures."""
    c = await Cluster(ttft_slo_ms=1e9, prefill_tok_s=100_000.0).start()
    plan = await c.submit("r1", 100)
    assert (plan.pipeline, plan.md_computes_suffix, plan.md_suffix_reason) == ("p-md", 100, "extend-cheaper")
    assert plan.estimates.md_push_ms > plan.estimates.md_extend_ms > 0
    target = next(t for t in c.tasks["prefill-0"].targets if t.instance_id == "md-0")
    assert (target.start, target.wan, c.tasks["md-0"].kv_start) == (100, True, 100)
    assert c.backlog == 0 and len(c.scheduler.backlog) == 0
    prefill, rld, md = INSTANCES
    monkeypatch.setattr(sys.modules[__name__], "INSTANCES", [prefill, rld, dataclasses.replace(md, dtype="bfloat16")])
    mixed = await Cluster(ttft_slo_ms=1e9, prefill_tok_s=100_000.0).start()
    plan = await mixed.submit("r2", 100)
    assert (plan.md_computes_suffix, plan.md_suffix_reason, mixed.tasks["md-0"].kv_start) == (0, "dtypes-differ", 0)
    assert mixed.backlog == 100 * 23_040  # float32 KV into bfloat16 crosses as bf16


async def test_nothing_is_counted_for_kv_that_stays_in_datacenter_a():
    c = await Cluster(anomalous_min_uncached=64, anomalous_max_output=100).start()
    plan = await c.submit("r1", 100, max_tokens=10)  # anomalous: p-rld, KV only to the relay
    assert (plan.pipeline, plan.reason, c.backlog) == ("p-rld", "anomalous", 0)


async def test_a_failed_dispatch_leaves_nothing_on_the_line():
    c = await Cluster(ttft_slo_ms=1e9).start()
    c.refuse.add("md-0")
    plan = await c.submit("r1", 100)
    assert plan.status == 429 and c.backlog == 0 and len(c.scheduler.backlog) == 0


async def test_only_the_decoder_a_requests_kv_crosses_to_may_report_its_transfer():
    """A sample moves the bandwidth estimate every plan reads: one from any other instance, for
    a request not on the line, or naming none (an old decoder's, which still decodes) is refused."""
    c = await Cluster(ttft_slo_ms=1e9).start()
    await c.submit("r1", 100)
    legacy = WanSample.decode(msgpack.packb({"nbytes": 4_608_000, "seconds": 0.5}))  # no request id
    assert legacy.request_id == ""
    await c.publish(subjects.wan_sample("md-0"), legacy)
    await c.publish(subjects.wan_sample("rld-0"), WanSample(100 * 46_080, 0.001, "r1"))  # not r1's receiver
    await c.publish(subjects.wan_sample("md-0"), WanSample(100 * 46_080, 0.001, "r9"))  # never dispatched
    await c.publish(subjects.wan_sample("md-0"), WanSample(100 * 46_080, float("inf"), "r1"))  # out of range
    assert c.backlog == 100 * 46_080 and len(c.scheduler.wan) == 0
    await c.publish(subjects.wan_sample("md-0"), WanSample(100 * 46_080, 0.5, "r1"))
    assert c.backlog == 0 and len(c.scheduler.wan) == 1


async def test_the_line_backlog_flips_the_next_plan_and_the_knob_ignores_it():
    """1000 tokens = 46 MB at the 1 Gbps prior: 369 ms on an idle line, 464 ms to MD's first token
    with a 10 ms prefill; the SLO is 600 ms, so the second request, planned behind the first's KV
    (another 369 ms), goes through the relay."""
    fast = {"ttft_slo_ms": 600.0, "prefill_tok_s": 100_000.0, "relay_finishes": False}
    on = await Cluster(**fast).start()
    plans = [await on.submit(f"r{k}", 1000) for k in range(2)]
    assert [(p.pipeline, p.reason) for p in plans] == [("p-md", "slo-met-md"), ("p-rld-md", "slo-miss-relay")]
    assert on.backlog == 2 * 1000 * 46_080  # the relayed request's KV still crosses for MD
    off = await Cluster(**fast, line_backlog=False).start()
    plans = [await off.submit(f"r{k}", 1000) for k in range(2)]
    assert [p.pipeline for p in plans] == ["p-md", "p-md"] and plans[1].estimates.wan_backlog_bytes == 0


def test_the_scheduler_bounds_the_map_by_the_request_timeout():
    s = Scheduler(config_from_dict(CONFIG), PolicyConfig())
    assert s.backlog.max_age_s == 60


def test_recent_plans_are_kept_for_resubmissions_then_forgotten(monkeypatch):
    """The replies kept for a resubmitted request id live `plan_memory_s` (4 submit timeouts),
    not until 10,000 have piled up: a busy scheduler's memory stays flat."""
    import services.scheduler.service as service

    s = Scheduler(config_from_dict(CONFIG), PolicyConfig())
    assert s.plan_memory_s == 4 * 3 * s.cfg.timeouts.control_s
    clock = [1000.0]
    monkeypatch.setattr(service.time, "monotonic", lambda: clock[0])
    for k in range(5):
        s._remember(Plan(f"r{k}", pipeline="p-md"))
        clock[0] += 1.0
    assert list(s.plans) == [f"r{k}" for k in range(5)]
    clock[0] += s.plan_memory_s - 4.5  # r0 is now older than the memory, r1.. are not
    s._remember(Plan("r5", pipeline="p-md"))
    assert list(s.plans) == ["r1", "r2", "r3", "r4", "r5"]
    s._remember(Plan("r1", pipeline="p-rld-md"))  # re-planned: the newer reply, at the end
    assert list(s.plans)[-1] == "r1" and s.plans["r1"][1].pipeline == "p-rld-md"
    monkeypatch.setattr(service, "MAX_PLANS", 3)
    s._remember(Plan("r6", pipeline="p-md"))
    assert list(s.plans) == ["r5", "r1", "r6"]  # and never more than MAX_PLANS
