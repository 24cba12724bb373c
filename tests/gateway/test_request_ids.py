"""Request ids as namespaces of keys (`auth.scoped_request_id`), without a cluster: the stages know
a client's id in its key's namespace, so another key sending the same `X-Request-Id` (or one
shaped like a moved attempt, `<id>.m1`) gets a request of its own, never the other's plan or
stream; the client sees its own id throughout. The scheduler here is an in-memory one that, as
the real one does, answers an id it planned before with that plan (its idempotency)."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

from services.gateway.auth import OPEN, TAG_CHARS, KeyRing, scoped_request_id
from services.gateway.flow import RequestFlow
from services.gateway.gateway import Gateway
from services.gateway.openai_api import ParsedRequest
from shared import subjects
from shared.config import load_config
from shared.messages import Plan, Sampling, Submit

ALICE, BOB = "sk-alice-7f2c", "sk-bob-19ad"


def keys():
    ring = KeyRing.from_settings("", {"PDD_API_KEYS": f"{ALICE},{BOB}"})
    return ring.keys


def parsed() -> ParsedRequest:
    return ParsedRequest(kind="completion", model="m", prompt_ids=[1, 2], sampling=Sampling(max_tokens=5))


class RememberingScheduler:
    """Plans each new id once and answers a resubmitted id with its earlier plan, stream key and
    all, as services/scheduler/service.py does for a client that retries on another gateway."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        self.dispatches = itertools.count()

    async def on_submit(self, sub: Submit) -> Plan:
        if sub.request_id not in self.plans:
            dispatch = f"d{next(self.dispatches)}"
            plan = Plan(sub.request_id, prefill="prefill-0", md="md-0", stream_key=sub.stream_key, dispatch_id=dispatch)
            self.plans[sub.request_id] = plan
        return self.plans[sub.request_id]


def test_each_key_is_its_own_namespace_and_the_same_on_every_gateway():
    alice, bob = keys()
    assert scoped_request_id(alice, "job-1") != scoped_request_id(bob, "job-1")
    again = KeyRing.from_settings("", {"PDD_API_KEYS": f"{BOB},{ALICE}"}).keys[1]  # another gateway, other order
    assert scoped_request_id(again, "job-1") == scoped_request_id(alice, "job-1")
    scoped = scoped_request_id(alice, "job-1")
    assert scoped.startswith("job-1@") and len(scoped) == len("job-1@") + TAG_CHARS  # the stages' logs grep as before
    assert scoped_request_id(OPEN, "job-1") == "job-1"  # the open gateway: one tenant, ids as given
    # no id of Bob's names Alice's request or a moved attempt of it, however it is shaped
    for given in ("job-1", "job-1.m1", scoped, scoped + ".m1", scoped.replace("@", ":")):
        assert scoped_request_id(bob, given) not in (scoped, scoped + ".m1")


async def test_another_key_reusing_an_id_gets_its_own_plan_and_stream(nats):
    """Alice's request was planned (its plan and stream key remembered by id); Bob sends her id.
    Without the namespace the scheduler handed Bob Alice's plan, and Bob's gateway listened on her
    stream's subject; now Bob's request is planned apart. Alice retrying with her id (another
    gateway) still gets hers back."""
    scheduler = RememberingScheduler()
    await nats.client("scheduler").serve(subjects.SUBMIT, Submit, scheduler.on_submit)
    cfg = load_config(None)

    async def forget_request(request_id: str) -> None:
        pass

    def gateway(name: str):
        bus = nats.client(name)
        return SimpleNamespace(cfg=cfg, bus=bus, cache_salt=lambda key: key.name, forget_request=forget_request)

    alice, bob = keys()
    hers = RequestFlow(gateway("gateway-0"), parsed(), alice, "job-1")
    await hers.start()
    theirs = RequestFlow(gateway("gateway-1"), parsed(), bob, "job-1")
    await theirs.start()
    assert theirs.request_id == "job-1"  # Bob sees the id he sent
    assert theirs.plan.dispatch_id != hers.plan.dispatch_id and theirs.stream_key != hers.stream_key
    assert theirs.attempt_id != hers.attempt_id
    retried = RequestFlow(gateway("gateway-1"), parsed(), alice, "job-1")
    await retried.start()
    assert retried.plan.dispatch_id == hers.plan.dispatch_id and retried.stream_key == hers.stream_key
    submitted = [s.request_id for s in nats.sent(subjects.SUBMIT)]
    assert submitted == [hers.scoped_id, theirs.scoped_id, hers.scoped_id]


async def test_a_moved_attempt_stays_in_its_keys_namespace(nats):
    scheduler = RememberingScheduler()
    await nats.client("scheduler").serve(subjects.SUBMIT, Submit, scheduler.on_submit)

    async def nothing(*_) -> None:
        pass

    gw = SimpleNamespace(
        cfg=load_config(None), bus=nats.client("gateway"), cache_salt=lambda key: "", forget_request=nothing
    )
    alice, _ = keys()
    f = RequestFlow(gw, parsed(), alice, "job-2")
    await f.start()
    await f._migrate({"md-0"})
    assert f.attempt_id == f"{scoped_request_id(alice, 'job-2')}.m1" and f.request_id == "job-2"


async def test_two_keys_may_have_one_id_in_flight_on_one_gateway():
    """An id in flight for one key is no sign for another: Bob keeps "job-3" while Alice's runs
    (a fresh id would have told him someone else is using it); Alice's second "job-3" gets a
    fresh one, as before."""
    gw = Gateway(load_config(None))
    gw.keys = KeyRing.from_settings("", {"PDD_API_KEYS": f"{ALICE},{BOB}"})
    gw.forget_request = lambda request_id: asyncio.sleep(0)  # no Redis behind this test
    alice, bob = gw.keys.keys
    hers, his, again = (gw.admit(parsed(), k, "job-3") for k in (alice, bob, alice))
    assert hers.request_id == his.request_id == "job-3" and again.request_id not in ("", "job-3")
    assert set(gw.inflight) == {hers.scoped_id, his.scoped_id, again.scoped_id} and len(gw.inflight) == 3
    for flow in (hers, his, again):
        await gw.release(flow)
    assert gw.inflight == {}
