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
from shared.messages import Plan, Sampling, Submit
from tests.fakes import InMemoryNats
from tests.helpers import until

SHORT_CONTROL_S = 0.05  # the gateway waits 3x this for a plan: for the test that waits it out


@pytest.fixture
async def nats():
    server = InMemoryNats()
    yield server
    for task in list(server.tasks):
        task.cancel()


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
