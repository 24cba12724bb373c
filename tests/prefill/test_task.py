"""Prefill's task handler against a real engine thread (`EngineWorker`) on an in-memory bus.

A task is acked on the event loop, not once the engine took it: the engine takes new work only
at a step boundary, and on a busy CPU a step (a prefill chunk) can outlast the scheduler's
control-plane timeout, which would then take a busy prefill for a dead one and plan around it
(a fresh clone's burst test saw five requests refused that way). Here the engine thread is held
in a long "step" by a command that waits on an event; the test releases it only after the ack
came, so without the fix the ack never comes and the test fails at its deadline."""

from __future__ import annotations

import asyncio
import threading

from shared import subjects
from shared.messages import Abort, Ack, Drop, KVTarget, Plan, PrefillTask, Sampling
from tests.decoder.harness import idle

DEADLINE_S = 30.0  # a failure guard: the ack comes at once, or never (without the fix)


def _task(rid: str, secret: str = "t") -> PrefillTask:
    target = KVTarget("md-0", "md", "127.0.0.1", 9, transfer_secret=secret)  # never reached: aborted before it runs
    return PrefillTask(
        rid,
        list(range(3, 40)),
        Sampling(max_tokens=4),
        [target],
        Plan(rid, prefill="prefill-0", md="md-0", stream_key="k"),
    )


async def _until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_task_is_acked_while_the_engine_is_in_a_long_step_and_an_abort_after_it_still_lands(prefill):
    scheduler, worker = prefill.nats.client("scheduler"), prefill.worker
    step = threading.Event()
    in_step = worker.submit(lambda e: step.wait(DEADLINE_S))  # the engine thread is busy until released
    try:
        ack = await asyncio.wait_for(
            scheduler.request(subjects.prefill_task("prefill-0"), _task("r1"), Ack, DEADLINE_S), DEADLINE_S
        )
        assert ack.ok, ack
        assert not in_step.done()  # acked while the engine was still in its step
        assert prefill.held_requests() == ["r1"]
        await scheduler.publish(subjects.ABORT, Abort("r1", reason="the client left"))  # queued after the add
        await _until(lambda: not prefill.held_requests(), "prefill to let go of r1")
    finally:
        step.set()
    await in_step
    await worker.call(lambda e: None)  # every command queued so far (the add, then the abort) has run
    assert await worker.call(lambda e: e.find("r1") is None and idle(e))  # the abort found it: nothing held


async def test_the_schedulers_drop_lets_go_of_a_late_task_and_ends_nothing_else(prefill):
    """The scheduler gave up on this prefill's ack and planned the request again elsewhere under
    the same id. The task it still holds must go quietly: computed and pushed to decoders that let
    go of it, its failed push would publish the broadcast abort and end the new plan too."""
    scheduler = prefill.nats.client("scheduler")
    assert (await scheduler.request(subjects.prefill_task("prefill-0"), _task("r1"), Ack, DEADLINE_S)).ok
    await scheduler.publish(subjects.prefill_drop("prefill-0"), Drop("r1", reason="re-planned"))
    await _until(lambda: not prefill.held_requests(), "prefill to let go of r1")
    await prefill.worker.call(lambda e: None)  # the add, then the abort, have run
    assert await prefill.worker.call(lambda e: e.find("r1") is None and idle(e))
    # the drop came before the task (they travel on two subjects): the task is refused
    await scheduler.publish(subjects.prefill_drop("prefill-0"), Drop("r2", reason="re-planned"))
    late = await scheduler.request(subjects.prefill_task("prefill-0"), _task("r2"), Ack, DEADLINE_S)
    assert not late.ok and "aborted" in late.error
    assert prefill.held_requests() == []
    # nothing of either went out but r1's first token, if it was sampled before the drop came (the
    # gateway takes a first token only from its plan's prefill): no abort to every stage, no error
    out = [(s, m) for s, m in prefill.nats.published if s == subjects.ABORT or s.startswith("pdd.tokens.")]
    assert all(s == subjects.tokens("r1", "k") and m.index == 0 and not m.error for s, m in out), out


async def test_a_drop_names_its_copy_and_a_re_plans_copy_on_the_same_prefill_goes_on(prefill):
    """Prefill is dispatched beside the decoders, so a decoder that did not answer has the request
    planned again while this prefill holds it, and the re-plan may pick this prefill again. The
    scheduler's drop names the earlier copy by its secrets; the two travel on different subjects,
    so the new copy may come first (it replaces the earlier one) or after (it is taken: only the
    named copy is refused)."""
    scheduler, worker = prefill.nats.client("scheduler"), prefill.worker
    step = threading.Event()
    in_step = worker.submit(lambda e: step.wait(DEADLINE_S))  # nothing computes (or pushes) meanwhile

    async def task(rid: str, secret: str) -> Ack:
        return await scheduler.request(subjects.prefill_task("prefill-0"), _task(rid, secret), Ack, DEADLINE_S)

    def held_secret(rid: str) -> str | None:
        state = prefill.requests.get(rid)
        return state.task.targets[0].transfer_secret if state else None

    try:
        assert (await task("r1", "first")).ok
        assert (await task("r1", "first")).ok and held_secret("r1") == "first"  # delivered twice: one copy
        assert (await task("r1", "second")).ok and held_secret("r1") == "second"  # the re-plan's copy came first
        await scheduler.publish(subjects.prefill_drop("prefill-0"), Drop("r1", "re-planned", transfer_secret="first"))
        await _until(lambda: not prefill.nats.tasks, "the drop to be handled")
        assert held_secret("r1") == "second"  # the drop found nothing of its own
        assert not (await task("r1", "first")).ok  # the dropped copy, were it to come again

        await scheduler.publish(subjects.prefill_drop("prefill-0"), Drop("r2", "re-planned", transfer_secret="old"))
        await _until(lambda: not prefill.nats.tasks, "the drop to be handled")
        late = await task("r2", "old")  # the drop came before its copy: that copy is refused ...
        assert not late.ok and "dropped" in late.error
        assert (await task("r2", "new")).ok and held_secret("r2") == "new"  # ... the re-plan's is taken
        await scheduler.publish(subjects.prefill_drop("prefill-0"), Drop("r2", "re-planned", transfer_secret="new"))
        await _until(lambda: prefill.held_requests() == ["r1"], "prefill to let go of r2's named copy")
    finally:
        step.set()
    await in_step
    await scheduler.publish(subjects.ABORT, Abort("r1"))
    await _until(lambda: not prefill.held_requests(), "prefill to let go of r1")
    await worker.call(lambda e: None)
    assert await worker.call(lambda e: e.find("r1") is None and e.find("r2") is None and idle(e))


async def test_a_failed_wan_push_drops_main_decodes_copy_by_its_secret(prefill):
    """Only main-decode's push failed: the relay finishes the request, and main-decode is told to
    drop the copy this task pushed to, named by its secret (a re-plan's copy would be kept)."""
    rld = KVTarget("rld-0", "rld", "127.0.0.1", 9, transfer_secret="relay-secret")
    md = KVTarget("md-0", "md", "127.0.0.1", 9, transfer_secret="md-secret", wan=True)
    plan = Plan("r1", pipeline="p-rld-md", handoff="oneshot", prefill="prefill-0", rld="rld-0", md="md-0")
    task = PrefillTask("r1", list(range(3, 40)), Sampling(max_tokens=4), [rld, md], plan)
    await prefill._degrade(task, [(md, ConnectionError("the line dropped"))])
    (finish,) = prefill.nats.sent(subjects.finish_on_relay("rld-0"))
    (drop,) = prefill.nats.sent(subjects.decode_drop("md-0"))
    assert (finish.request_id, drop.request_id, drop.transfer_secret) == ("r1", "r1", "md-secret")
    assert not prefill.nats.sent(subjects.ABORT)
