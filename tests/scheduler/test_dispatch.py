"""The scheduler's dispatch and the request records it writes (`pdd:request:<id>`), against a real
redis-server, with the stages answering on an in-memory bus: a plan whose dispatch fails leaves
no record behind (a migrating gateway retries under new attempt ids and forgets only the last
one, so a record left here stayed until its TTL; the soak found one after a 429 retry), and an
abort removes the record, even one that lands while the plan is still being dispatched."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from services.scheduler import service
from services.scheduler.service import Scheduler
from shared import subjects
from shared.config import load_config
from shared.messages import Abort, Ack, DecodeTask, InstanceInfo, PrefillTask, Sampling, Submit
from shared.registry import Registry
from tests.fakes import InMemoryNats
from tests.helpers import until


def instance(instance_id: str, role: str, dc: str) -> InstanceInfo:
    return InstanceInfo(instance_id, role, dc, total_blocks=1024, free_blocks=1024)


@pytest.fixture
async def registry(registry):
    """The redis-server's registry with heartbeats that outlive any test, however slow the machine."""
    return Registry(registry.r, ttl_s=600.0)


@pytest.fixture
async def scheduler(registry):
    for info in (instance("prefill-0", "prefill", "A"), instance("md-0", "md", "B")):
        await registry.heartbeat(info)
    sched = Scheduler(load_config(None))
    sched.bus, sched.registry = InMemoryNats().client("scheduler"), registry
    yield sched
    await sched.bus.close()


async def answer(sched: Scheduler, instance_id: str, msg_type: type, ack: Ack) -> None:
    """The instance answers each of its tasks with `ack` (for the task's request)."""

    async def on_task(task):
        return Ack(task.request_id, ack.ok, ack.error, ack.busy)

    subject = (subjects.prefill_task if msg_type is PrefillTask else subjects.decode_task)(instance_id)
    await sched.bus.server.client(instance_id).serve(subject, msg_type, on_task)


def submit(request_id: str) -> Submit:
    return Submit(request_id, list(range(40)), Sampling(max_tokens=8), pipeline="p-md")


async def test_a_dispatched_plan_is_recorded(scheduler, registry):
    await answer(scheduler, "md-0", DecodeTask, Ack(""))
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    plan = await scheduler.on_submit(submit("cmpl-1"))
    assert not plan.error and (plan.prefill, plan.md) == ("prefill-0", "md-0")
    assert await registry.request_ids() == ["cmpl-1"]  # the gateway removes it when the request ends


@pytest.mark.parametrize("refuser", ["md-0", "prefill-0"])
async def test_a_refused_dispatch_leaves_no_record(scheduler, registry, refuser):
    full = Ack("", ok=False, error="full", busy=True)
    await answer(scheduler, "md-0", DecodeTask, full if refuser == "md-0" else Ack(""))
    await answer(scheduler, "prefill-0", PrefillTask, full if refuser == "prefill-0" else Ack(""))
    plan = await scheduler.on_submit(submit("cmpl-2.m1"))
    assert plan.status == 429 and "full" in plan.error
    assert await registry.request_ids() == []


async def test_a_plan_around_an_unreachable_instance_is_recorded_once_without_it(scheduler, registry):
    await registry.heartbeat(instance("md-1", "md", "B"))
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    await answer(scheduler, "md-1", DecodeTask, Ack(""))  # md-0 has no responder: dead, heartbeat not expired
    plan = await scheduler.on_submit(submit("cmpl-3"))
    assert not plan.error and plan.md == "md-1"
    assert await registry.request_ids() == ["cmpl-3"]
    assert (await registry.r.hgetall("pdd:request:cmpl-3"))["md"] == "md-1"  # the re-plan's record
    # prefill-0 took the first copy beside md-0's silence, and is the re-plan's prefill too: the
    # drop names the first copy (by its secret) and the first token it may have sent (by its dispatch)
    first, second = scheduler.bus.server.sent(subjects.prefill_task("prefill-0"))
    (drop,) = scheduler.bus.server.sent(subjects.prefill_drop("prefill-0"))
    assert drop.transfer_secret == first.targets[0].transfer_secret != second.targets[0].transfer_secret
    assert first.plan.dispatch_id != second.plan.dispatch_id == plan.dispatch_id


async def test_main_decode_silent_behind_a_relay_that_took_its_task_leaves_the_relay_finishing(scheduler, registry):
    """p-rld-md: prefill (dispatched beside main-decode) may already be pushing to the relay when
    md-0 turns out silent. Planning again would meet a relay already running this copy; instead
    the relay finishes the request, as when main-decode's KV cannot be delivered."""
    await registry.heartbeat(instance("rld-0", "rld", "A"))
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    await answer(scheduler, "rld-0", DecodeTask, Ack(""))  # md-0 has no responder
    plan = await scheduler.on_submit(dataclasses.replace(submit("cmpl-12"), pipeline="p-rld-md"))
    assert (plan.error, plan.pipeline, plan.rld, plan.md) == ("", "p-rld", "rld-0", "")
    assert "md-0 did not answer" in plan.reason
    (finish,) = scheduler.bus.server.sent(subjects.finish_on_relay("rld-0"))
    (drop,) = scheduler.bus.server.sent(subjects.decode_drop("md-0"))
    (prefill_task,) = scheduler.bus.server.sent(subjects.prefill_task("prefill-0"))  # not planned again
    md_secret = next(t.transfer_secret for t in prefill_task.targets if t.instance_id == "md-0")
    assert finish.request_id == drop.request_id == "cmpl-12" and drop.transfer_secret == md_secret
    assert not scheduler.bus.server.sent(subjects.prefill_drop("prefill-0"))
    assert (await registry.r.hgetall("pdd:request:cmpl-12"))["md"] == ""  # the record is the relay's alone
    assert scheduler.backlog.total(time.monotonic()) == 0  # none of its KV will cross


async def test_prefill_is_dispatched_without_waiting_for_the_decoders_acks(scheduler, registry):
    """md-0 is across the line: its task and ack cost a round trip through it, which prefill must
    not wait for. Here md-0 answers only once prefill-0 has its task: dispatched one after the
    other, the plan would wait for md-0's ack until the control-plane timeout and fail."""
    prefill_has_it = asyncio.Event()

    async def prefill_task(task):
        prefill_has_it.set()
        return Ack(task.request_id)

    async def md_task(task):
        await asyncio.wait_for(prefill_has_it.wait(), scheduler.cfg.timeouts.control_s * 2)
        return Ack(task.request_id)

    await scheduler.bus.server.client("md-0").serve(subjects.decode_task("md-0"), DecodeTask, md_task)
    await scheduler.bus.server.client("prefill-0").serve(subjects.prefill_task("prefill-0"), PrefillTask, prefill_task)
    plan = await scheduler.on_submit(submit("cmpl-11"))
    assert (plan.error, plan.prefill, plan.md) == ("", "prefill-0", "md-0") and plan.dispatch_id
    assert len(scheduler.bus.server.sent(subjects.decode_task("md-0"))) == 1  # once: no re-plan


async def test_a_stage_moving_to_another_nats_server_is_asked_again_not_planned_around(
    scheduler, registry, monkeypatch
):
    """Prefill's NATS server died and it is reconnecting to another: its task meets "no
    responders" until its subscription is back; the scheduler asks again (a task nobody took is
    safe to resend) and the request is planned on it, rather than 503 for want of a prefill."""
    monkeypatch.setattr(service, "NO_RESPONDERS_S", 600.0)  # bounded by control_s: no race with this test's speed
    await answer(scheduler, "md-0", DecodeTask, Ack(""))
    asked, request = [], scheduler.bus.request

    async def counted(subject, msg, reply_type, timeout):
        asked.append(subject)
        return await request(subject, msg, reply_type, timeout)

    scheduler.bus.request = counted
    planning = asyncio.create_task(scheduler.on_submit(submit("cmpl-12")))
    await until(lambda: asked.count(subjects.prefill_task("prefill-0")) >= 2, what="prefill asked again")
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))  # its subscription is back
    plan = await planning
    assert not plan.error and plan.prefill == "prefill-0", plan
    assert "prefill-0" not in scheduler.unreachable


async def test_an_unreachable_prefill_leaves_no_record(scheduler, registry):
    await answer(scheduler, "md-0", DecodeTask, Ack(""))  # prefill-0 has no responder
    plan = await scheduler.on_submit(submit("cmpl-4"))
    assert plan.status == 503 and "prefill" in plan.error
    assert [m.request_id for m in scheduler.bus.server.sent(subjects.decode_drop("md-0"))] == ["cmpl-4"]
    assert [m.request_id for m in scheduler.bus.server.sent(subjects.prefill_drop("prefill-0"))] == ["cmpl-4"]
    assert await registry.request_ids() == []


async def test_a_prefill_that_did_not_ack_in_time_is_told_to_let_go_of_the_re_planned_request(scheduler, registry):
    """A prefill busy, not dead, may take its task after the scheduler gave up waiting. Planned
    again under the same id, the request must not be ended by that late copy: its KV push to
    decoders that let go of it fails, and a failed push ends the request everywhere."""
    await registry.heartbeat(instance("prefill-1", "prefill", "A"))
    await answer(scheduler, "md-0", DecodeTask, Ack(""))
    await answer(scheduler, "prefill-1", PrefillTask, Ack(""))  # prefill-0 has no responder
    plan = await scheduler.on_submit(submit("cmpl-9"))  # prefill-0 first: equal costs go by id
    assert (plan.error, plan.prefill, plan.md) == ("", "prefill-1", "md-0")
    assert [m.request_id for m in scheduler.bus.server.sent(subjects.prefill_drop("prefill-0"))] == ["cmpl-9"]
    (drop,) = scheduler.bus.server.sent(subjects.decode_drop("md-0"))
    first, second = scheduler.bus.server.sent(subjects.decode_task("md-0"))
    assert drop.request_id == first.request_id == second.request_id == "cmpl-9"
    assert drop.transfer_secret == first.transfer_secret != second.transfer_secret  # the first plan's copy only
    assert not scheduler.bus.server.sent(subjects.prefill_drop("prefill-1"))


async def test_an_abort_during_the_dispatch_removes_the_record_after_it(scheduler, registry):
    """The gateway gave up on a plan (timeout, client gone) and aborted it while md-0 was still
    taking its task: the record written before the dispatch must not outlive it."""
    md_may_answer = asyncio.Event()

    async def on_task(task):
        await md_may_answer.wait()
        return Ack(task.request_id)

    await scheduler.bus.server.client("md-0").serve(subjects.decode_task("md-0"), DecodeTask, on_task)
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    planning = asyncio.create_task(scheduler.on_submit(submit("cmpl-5")))
    await until(lambda: scheduler.bus.server.sent(subjects.decode_task("md-0")), what="md-0's task")
    assert await registry.request_ids() == ["cmpl-5"]  # recorded before the dispatch
    await scheduler.on_abort(Abort("cmpl-5", reason="the gateway stopped waiting for its plan"))
    md_may_answer.set()
    plan = await planning
    assert plan.status == 503 and "aborted" in plan.error
    assert await registry.request_ids() == []
    assert scheduler.backlog.total(time.monotonic()) == 0  # none of its KV is on the line


async def test_an_abort_before_the_kv_is_counted_on_the_line_leaves_none_counted(scheduler, registry, monkeypatch):
    """The abort lands while the scheduler reads the fleet again to plan around main-decode,
    which did not answer, before it counts the new plan's KV on the WAN; the stages (which took
    the tasks before the abort reached them) drop it. (A first plan reads the fleet before its
    claim: nothing awaits between its claim and the count.)"""
    await registry.heartbeat(instance("md-1", "md", "B"))
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    await answer(scheduler, "md-1", DecodeTask, Ack(""))  # md-0 has no responder
    read_fleet, reads = registry.alive, []

    async def alive_then_aborted():
        fleet = await read_fleet()
        reads.append(len(fleet))
        if len(reads) == 2:  # the re-plan's
            await scheduler.on_abort(Abort("cmpl-8"))
        return fleet

    monkeypatch.setattr(registry, "alive", alive_then_aborted)
    plan = await scheduler.on_submit(submit("cmpl-8"))
    assert len(reads) == 2 and plan.status == 503 and "aborted" in plan.error
    assert await registry.request_ids() == []
    assert scheduler.backlog.total(time.monotonic()) == 0


async def test_an_abort_after_the_dispatch_removes_the_record(scheduler, registry):
    await answer(scheduler, "md-0", DecodeTask, Ack(""))
    await answer(scheduler, "prefill-0", PrefillTask, Ack(""))
    for rid in ("cmpl-6", "cmpl-7"):
        assert not (await scheduler.on_submit(submit(rid))).error
    await scheduler.on_abort(Abort("cmpl-6", keep_kv=True))  # finished on the relay: md still takes its KV
    await scheduler.on_abort(Abort("cmpl-7"))
    assert await registry.request_ids() == ["cmpl-6"]


async def test_a_prefill_that_missed_its_ack_stays_out_of_the_re_plan_even_if_it_heartbeats(
    scheduler, registry, monkeypatch
):
    """prefill-0 heartbeats between its missed ack and the re-plan (a busy instance, alive): the
    scheduler would take it back, but it was told to drop this request and would refuse it."""
    await registry.heartbeat(instance("prefill-1", "prefill", "A"))
    await answer(scheduler, "md-0", DecodeTask, Ack(""))
    await answer(scheduler, "prefill-1", PrefillTask, Ack(""))  # prefill-0 has no responder
    read_fleet, reads = registry.alive, []

    async def prefill_0_heartbeats_after_its_miss():
        if reads:  # the re-plan's read: prefill-0's heartbeat is newer than its miss
            await registry.heartbeat(instance("prefill-0", "prefill", "A"))
        reads.append(1)
        return await read_fleet()

    monkeypatch.setattr(registry, "alive", prefill_0_heartbeats_after_its_miss)
    plan = await scheduler.on_submit(submit("cmpl-10"))
    assert (plan.error, plan.prefill) == ("", "prefill-1") and len(reads) == 2
    assert [m.request_id for m in scheduler.bus.server.sent(subjects.prefill_drop("prefill-0"))] == ["cmpl-10"]
    assert scheduler._answering(next(i for i in await read_fleet() if i.id == "prefill-0"))  # back for others


async def test_a_request_that_cannot_be_recorded_is_not_dispatched(scheduler, registry, monkeypatch):
    """Every holder's heartbeat checks the record: a request dispatched without one would be
    dropped mid-stream, so a failed write fails the plan (503) before any stage holds it."""
    tasks: list[str] = []

    async def on_task(task):
        tasks.append(task.request_id)
        return Ack(task.request_id)

    for iid, msg_type in (("md-0", DecodeTask), ("prefill-0", PrefillTask)):
        subject = (subjects.prefill_task if msg_type is PrefillTask else subjects.decode_task)(iid)
        await scheduler.bus.server.client(iid).serve(subject, msg_type, on_task)

    async def broken(*args, **kwargs):
        raise ConnectionError("Redis is restarting")

    monkeypatch.setattr(registry, "set_request", broken)
    plan = await scheduler.on_submit(submit("cmpl-unrecorded"))
    assert plan.status == 503 and "could not record the request" in plan.error
    assert tasks == [], "no stage was given the request"
