"""Several schedulers, one cluster (control_plane.schedulers), against a real redis-server with
the stages on an in-memory bus: a resubmission gets the same plan whichever scheduler it reaches,
one claim per request (a second scheduler waits for the first's plan, or takes the claim over once
the first died), each scheduler hears the line's backlog of the others, and the registrars of
several schedulers apply one instance's index updates in order, whichever of them gets each."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler.registrar import Registrar
from services.scheduler.service import Scheduler
from shared import registry as registry_module
from shared import subjects
from shared.config import load_config
from shared.messages import (
    Ack,
    DecodeTask,
    Heartbeat,
    IndexEvent,
    IndexUpdate,
    InstanceInfo,
    PrefillTask,
    Sampling,
    Submit,
)
from shared.registry import PLAN, Registry
from tests.fakes import InMemoryNats


@pytest.fixture
async def registry(registry):
    return Registry(registry.r, ttl_s=600.0)


@pytest.fixture
async def schedulers(registry):
    """Two schedulers on one bus and one Redis, both present; prefill-0 and md-0 ack every task."""
    for info in (InstanceInfo("prefill-0", "prefill", "A"), InstanceInfo("md-0", "md", "B")):
        info.total_blocks = info.free_blocks = 1024
        await registry.heartbeat(info)
    nats, tasks = InMemoryNats(), []
    pair = []
    for name in ("scheduler-0", "scheduler-1"):
        s = Scheduler(load_config(None), name=name)
        s.bus, s.registry = nats.client(name), registry
        await registry.r.hset(f"pdd:process:scheduler:{name}", mapping={"kind": "scheduler", "name": name})
        pair.append(s)

    async def ack(task):
        tasks.append(task)
        return Ack(task.request_id)

    stages = nats.client("stages")
    await stages.serve(subjects.prefill_task("prefill-0"), PrefillTask, ack)
    await stages.serve(subjects.decode_task("md-0"), DecodeTask, ack)
    yield pair, tasks
    for s in pair:
        await s.bus.close()


def submit(request_id: str) -> Submit:
    return Submit(request_id, list(range(40)), Sampling(max_tokens=8), pipeline="p-md")


async def test_a_resubmission_through_the_other_scheduler_gets_the_same_plan(schedulers):
    (first, second), tasks = schedulers
    plan = await first.on_submit(submit("cmpl-1"))
    again = await second.on_submit(submit("cmpl-1"))
    assert not plan.error and plan.scheduler == "scheduler-0"
    assert again == plan, "the second scheduler answered with the first one's plan"
    assert len(tasks) == 2, "dispatched once: one prefill task, one decode task"


async def test_two_schedulers_given_one_request_at_once_plan_it_once(schedulers):
    (first, second), tasks = schedulers
    a, b = await asyncio.gather(first.on_submit(submit("cmpl-2")), second.on_submit(submit("cmpl-2")))
    assert a == b and not a.error
    assert len(tasks) == 2


async def test_the_claim_of_a_scheduler_that_died_planning_is_taken_over(schedulers, registry):
    (_, second), tasks = schedulers
    await registry.r.set(PLAN + "cmpl-3", "planning scheduler-9", px=60_000)  # scheduler-9: no presence
    plan = await second.on_submit(submit("cmpl-3"))
    assert not plan.error and plan.scheduler == "scheduler-1" and len(tasks) == 2


async def test_a_claim_held_by_a_live_scheduler_is_waited_for_not_taken(schedulers, registry):
    (first, second), tasks = schedulers
    await registry.r.set(PLAN + "cmpl-4", "planning scheduler-0", px=60_000)
    waiting = asyncio.create_task(second.on_submit(submit("cmpl-4")))
    await asyncio.sleep(0.3)  # a claim that stands is not planned over (nothing dispatched meanwhile)
    assert not waiting.done() and tasks == []
    await registry.r.delete(PLAN + "cmpl-4")
    await first.on_submit(submit("cmpl-4"))  # ... and its claimer's plan is the answer
    assert await waiting == first.plans["cmpl-4"][1] and len(tasks) == 2


async def test_each_scheduler_counts_the_line_backlog_of_the_others(schedulers):
    (first, second), _ = schedulers
    first.cfg = second.cfg = load_config(None, control_plane={"schedulers": 2})
    await second.serve()
    plan = await first.on_submit(submit("cmpl-5"))  # md-0 is in B: its KV crosses the line
    await asyncio.gather(*first._tasks)
    await asyncio.gather(*list(first.bus.server.tasks))
    owed = first.backlog.total(time.monotonic())
    assert plan.md == "md-0" and owed > 0
    assert second.backlog.total(time.monotonic()) == owed, "told on the bus"


async def test_registrars_of_two_schedulers_apply_one_instances_updates_in_order(registry, monkeypatch):
    """Updates of one instance alternate between two registrars (a queue group), and the second
    handles its share late: a block stored by an update it got and removed by a later one the
    first got is gone from Redis, as the instance sent them; no resync is asked for."""
    # order, not the bound, is checked here: a loaded host overshot the shipped 0.2 s wait
    monkeypatch.setattr(registry_module, "INDEX_ORDER_WAIT_S", 10.0)
    regs = [Registrar(registry), Registrar(registry)]
    parts = [IndexUpdate("md-0", [IndexEvent("cleared"), IndexEvent("stored", ["h0"])], seq=1)]
    parts += [IndexUpdate("md-0", [IndexEvent("stored", [f"h{i}"])], seq=i + 1) for i in range(1, 20)]
    parts += [IndexUpdate("md-0", [IndexEvent("removed", ["h19"])], seq=21)]  # h19 came by the late one

    async def late(updates):
        await asyncio.sleep(0.05)
        await asyncio.gather(*(regs[1].on_index(u) for u in updates))

    await asyncio.gather(*(regs[0].on_index(u) for u in parts[0::2]), late(parts[1::2]))
    assert await registry.r.smembers("pdd:kv:md-0") == {f"h{i}" for i in range(0, 19)}
    beat = Heartbeat(InstanceInfo("md-0", "md", "B"))
    assert not (await regs[1].on_heartbeat(beat)).resync_index


async def test_a_claim_left_by_this_schedulers_previous_life_is_planned_over(schedulers, registry):
    """scheduler-1 restarted: a claim under its own name that it is not planning now is stale."""
    (_, second), tasks = schedulers
    await registry.r.set(PLAN + "cmpl-6", "planning scheduler-1", px=60_000)
    plan = await asyncio.wait_for(second.on_submit(submit("cmpl-6")), 5.0)
    assert not plan.error and plan.scheduler == "scheduler-1" and len(tasks) == 2
