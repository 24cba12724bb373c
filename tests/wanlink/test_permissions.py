"""Each role's NATS permissions (`pdd/natsconf.py`) against a real nats-server configured as the
launcher configures a site: every flow of the control plane's subject table (`shared/subjects.py`)
reaches its subscribers from each of its publishers, each connected as its role's user. A flow
the permissions leave out fails only on a cluster with credentials (two sites), where a message
the server refuses is dropped with an error in a log: the scheduler's drop for a prefill that
did not ack in time would never have arrived there."""

from __future__ import annotations

import pytest

from shared import subjects
from shared.bus import Bus
from shared.messages import WanControl, WanState
from tests.helpers import until

INSTANCES = ["prefill", "rld", "md"]
FLOWS = [  # subject, its publishers, its subscribers
    (subjects.SUBMIT, ["gateway"], ["scheduler"]),
    (subjects.prefill_task("prefill-0"), ["scheduler"], ["prefill"]),
    (subjects.prefill_drop("prefill-0"), ["scheduler"], ["prefill"]),
    (subjects.prefill_warm("prefill-0"), ["gateway"], ["prefill"]),
    (subjects.decode_task("md-0"), ["scheduler"], ["rld", "md"]),
    (subjects.decode_drop("md-0"), ["scheduler", "prefill"], ["rld", "md"]),
    (subjects.tokens("cmpl-1"), INSTANCES, ["gateway"]),
    (subjects.WAN_SAMPLE, ["rld", "md"], ["scheduler"]),
    (subjects.STATUS, ["gateway", "operator"], ["scheduler"]),
    (subjects.handoff_ready("rld-0"), ["md"], ["rld"]),
    (subjects.finish_on_relay("rld-0"), ["prefill", "md"], ["rld"]),
    (subjects.handoff_chunk("md-0"), ["rld"], ["md"]),
    (subjects.ABORT, ["gateway", "scheduler", "rld"], ["scheduler", *INSTANCES]),
    (subjects.HEARTBEAT, INSTANCES, ["scheduler"]),
    (subjects.INDEX, INSTANCES, ["scheduler"]),
    (subjects.LEAVE, INSTANCES, ["scheduler"]),
    (subjects.inspect("md-0"), ["operator"], INSTANCES),
    (subjects.flush_cache("md-0"), ["operator"], INSTANCES),
    (subjects.wan_control("wan"), ["gateway", "operator"], ["wanlink"]),
]
ROLES = ["gateway", "scheduler", "prefill", "rld", "md", "wanlink", "operator"]


@pytest.fixture
async def buses(nats_a, secrets):
    url, _ = nats_a
    buses = {role: await Bus.connect(url, f"{role}-perm", role, secrets) for role in ROLES}
    yield buses
    for bus in buses.values():
        await bus.close()


@pytest.mark.parametrize("subject, publishers, subscribers", FLOWS, ids=[f[0] for f in FLOWS])
async def test_each_flow_reaches_its_subscribers_from_each_publisher(buses, subject, publishers, subscribers):
    got: dict[str, set[bytes]] = {role: set() for role in subscribers}
    for role in subscribers:

        async def deliver(msg, role=role) -> None:
            got[role].add(msg.data)

        await buses[role].nc.subscribe(subject, cb=deliver)
        await buses[role].sync()  # the server has the subscription (or has refused it)
    for role in publishers:
        await buses[role].nc.publish(subject, role.encode())
        await buses[role].nc.flush()
    want = {role.encode() for role in publishers}
    await until(
        lambda: all(got[role] == want for role in subscribers),
        timeout=10.0,
        what=f"{subject} from {publishers} at {subscribers}",
    )
    assert all(buses[role].nc.last_error is None for role in publishers + subscribers)


@pytest.mark.parametrize(
    "role, subject",
    [
        ("md", subjects.prefill_drop("prefill-0")),  # main-decode cannot tell a prefill to drop a request
        ("prefill", subjects.ABORT),  # a prefill ends nothing for everyone: its failure goes to the gateway
        ("md", subjects.prefill_warm("prefill-0")),  # only the gateway feeds prefill's cache
    ],
)
async def test_a_role_may_not_send_what_another_role_sends(buses, role, subject):
    """The negative controls."""
    nc = buses[role].nc
    await nc.publish(subject, b"forged")
    await nc.flush()
    await until(lambda: nc.last_error is not None, timeout=10.0, what="the server's -ERR")
    assert "permissions violation" in str(nc.last_error).lower()


async def test_a_service_is_reachable_once_serve_returns(nats_a, secrets):
    """`Bus.serve` returns once the server routes to the new subscription: a request from another
    client right after it is answered, never "no responders". A plain flush after subscribing did
    not promise that (nats-py's PING can overtake the SUB on a new connection), and a wanlink test
    on a fresh clone met "no responders" that way; 300 new services catch it with near certainty."""
    url, _ = nats_a
    client = await Bus.connect(url, "request-test", "operator", secrets)
    try:
        for i in range(300):
            server = await Bus.connect(url, f"serve-test-{i}", "operator", secrets)
            subject = subjects.inspect(f"fresh-{i}")
            await server.serve(subject, WanControl, lambda msg: _state())
            try:
                await client.request(subject, WanControl(), WanState, 5.0)  # BusTimeout on "no responders"
            finally:
                await server.close()
    finally:
        await client.close()


async def _state() -> WanState:
    return WanState("serve-test")
