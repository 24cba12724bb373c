"""Submitting a request to the scheduler (`RequestFlow.start`), with the scheduler on an in-memory
bus: a submission the gateway stops waiting for (its plan timed out, or the client left while it
was planned) is aborted and its record forgotten, since the scheduler may still dispatch it; an
answered error plan is not (the scheduler has cleaned up after it). Two requests given one id
by their client each keep a flow of their own."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from services.gateway.auth import OPEN
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow
from services.gateway.gateway import Gateway
from services.gateway.openai_api import ParsedRequest
from shared import subjects
from shared.config import load_config
from shared.messages import Plan, Sampling, Submit, TokenChunk
from tests.fakes import InMemoryNats
from tests.helpers import until

SHORT_CONTROL_S = 0.05  # the gateway waits 3x this for a plan: for the test that waits it out


async def flow(nats: InMemoryNats, on_submit, control_s: float | None = None) -> tuple[RequestFlow, list[str]]:
    """A flow whose gateway talks to a scheduler answering with `on_submit`, and the request ids
    its gateway forgets. Only a test that waits for the timeout shortens it (`control_s`); the
    others keep the default, so a slow machine cannot turn their reply into a timeout."""
    cfg = load_config(None)
    if control_s is not None:
        cfg = dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, control_s=control_s))
    forgotten: list[str] = []

    async def forget_request(request_id: str) -> None:
        forgotten.append(request_id)

    await nats.client("scheduler").serve(subjects.SUBMIT, Submit, on_submit)
    gw = SimpleNamespace(cfg=cfg, bus=nats.client("gateway"), cache_salt=lambda key: "", forget_request=forget_request)
    parsed = ParsedRequest(kind="completion", model="m", prompt_ids=[1, 2], sampling=Sampling(max_tokens=5))
    return RequestFlow(gw, parsed, OPEN, "cmpl-submit"), forgotten


async def never_answers(sub: Submit) -> Plan:
    await asyncio.Event().wait()


def aborts(nats: InMemoryNats) -> list[str]:
    return [m.request_id for m in nats.sent(subjects.ABORT)]


async def test_a_plan_that_times_out_is_aborted(nats):
    f, forgotten = await flow(nats, never_answers, control_s=SHORT_CONTROL_S)
    with pytest.raises(APIError) as e:
        await f.start()
    assert e.value.status == 503 and "scheduler unavailable" in e.value.message
    assert aborts(nats) == ["cmpl-submit"] and forgotten == ["cmpl-submit"]


async def test_a_client_gone_while_planned_aborts_the_submission(nats):
    f, forgotten = await flow(nats, never_answers)
    starting = asyncio.create_task(f.start())
    await until(lambda: nats.sent(subjects.SUBMIT), what="the scheduler to have it")
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert aborts(nats) == ["cmpl-submit"] and forgotten == ["cmpl-submit"]


async def test_an_error_plan_is_not_aborted_again(nats):
    async def full(sub: Submit) -> Plan:
        return Plan(sub.request_id, error="md-0 refused: full", status=429)

    f, forgotten = await flow(nats, full)
    with pytest.raises(APIError) as e:
        await f.start()
    assert e.value.status == 429
    assert aborts(nats) == [] and forgotten == []


async def test_two_requests_with_one_client_id_each_keep_their_own_flow():
    """The front door checks a client's X-Request-Id before reading the body; a second request
    with the same id can pass that check while the first is read. Admission gives it a fresh id,
    so neither flow replaces the other in the gateway's table (where it would be neither aborted
    nor released), and releasing one leaves the other."""
    gw = Gateway(load_config(None))
    gw.forget_request = lambda request_id: asyncio.sleep(0)  # no Redis behind this test
    parsed = ParsedRequest(kind="completion", model="m", prompt_ids=[1, 2], sampling=Sampling(max_tokens=5))
    first, second = gw.admit(parsed, OPEN, "client-7"), gw.admit(parsed, OPEN, "client-7")
    assert first.request_id == "client-7" and second.request_id not in ("", "client-7")
    assert gw.inflight == {"client-7": first, second.request_id: second}
    await gw.release(first)
    assert gw.inflight == {second.request_id: second}
    await gw.release(second)
    assert gw.inflight == {} and gw.admit(parsed, OPEN, "client-7").request_id == "client-7"


async def test_the_stream_is_heard_only_under_the_key_the_plan_carries(nats):
    """The gateway mints a key per attempt and hears its tokens only under it: a chunk on the
    bare subject or another key (an instance not planned for it) never reaches the flow. A request
    picked up again (planned before, by another gateway) follows the plan's key."""

    async def plan_it(sub: Submit) -> Plan:
        return Plan(sub.request_id, prefill="prefill-0", md="md-0", stream_key=sub.stream_key)

    f, _ = await flow(nats, plan_it)
    await f.start()
    (sub,) = nats.sent(subjects.SUBMIT)
    assert len(sub.stream_key) >= 16 and f.stream_key == sub.stream_key
    prefill = nats.client("prefill-0")
    for key in ("", "guess"):
        await prefill.publish(subjects.tokens(f.attempt_id, key), TokenChunk(f.attempt_id, 0, [7], instance_id="md-0"))
    assert f._queue.empty()
    await prefill.publish(subjects.tokens(f.attempt_id, sub.stream_key), TokenChunk(f.attempt_id, 0, [7]))
    assert f._queue.qsize() == 1

    async def planned_before(sub: Submit) -> Plan:
        return Plan(sub.request_id, prefill="prefill-0", md="md-0", stream_key="earlier-gateways-key")

    g, _ = await flow(InMemoryNats(), planned_before)
    await g.start()
    assert g.stream_key == "earlier-gateways-key"
    await g.gw.bus.publish(subjects.tokens(g.attempt_id, "earlier-gateways-key"), TokenChunk(g.attempt_id, 0, [7]))
    assert g._queue.qsize() == 1
