"""Each NATS user's permissions (`pdd/natsconf.py`) against a real nats-server configured as
the launcher configures a site: every flow of the control plane's subject table
(`shared/subjects.py`) reaches its subscribers from each of its publishers, each connected as its
own user (a model instance by its id). A flow the permissions leave out fails only on a cluster
with credentials (two sites), where a message the server refuses is dropped with an error in a
log: the scheduler's drop for a prefill that did not ack in time would never have arrived there.
What one instance may not do to another is tests/security/'s."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdd.certs import make_secrets
from pdd.natsconf import server_conf
from pdd.servers import EmbeddedServer, free_port
from shared import subjects
from shared.bus import Bus
from shared.config import config_from_dict
from shared.messages import WanControl, WanState
from shared.security import Secrets
from tests.helpers import until

REPORTS = (subjects.heartbeat, subjects.index, subjects.leave)

INSTANCES = ["prefill-0", "rld-0", "md-0"]
FLOWS = [  # subject, its publishers, its subscribers
    (subjects.SUBMIT, ["gateway"], ["scheduler"]),
    (subjects.prefill_task("prefill-0"), ["scheduler"], ["prefill-0"]),
    (subjects.prefill_drop("prefill-0"), ["scheduler"], ["prefill-0"]),
    (subjects.prefill_warm("prefill-0"), ["gateway"], ["prefill-0"]),
    (subjects.decode_task("md-0"), ["scheduler"], ["md-0"]),
    (subjects.decode_task("rld-0"), ["scheduler"], ["rld-0"]),
    (subjects.decode_drop("md-0"), ["scheduler", "prefill-0"], ["md-0"]),
    (subjects.decode_resend("rld-0"), ["gateway"], ["rld-0"]),
    (subjects.tokens("cmpl-1"), INSTANCES, ["gateway"]),
    (subjects.wan_sample("md-0"), ["md-0"], ["scheduler"]),
    (subjects.STATUS, ["gateway", "operator"], ["scheduler"]),
    (subjects.handoff_ready("rld-0"), ["md-0"], ["rld-0"]),
    (subjects.finish_on_relay("rld-0"), ["prefill-0", "md-0"], ["rld-0"]),
    (subjects.handoff_chunk("md-0"), ["rld-0"], ["md-0"]),
    (subjects.ABORT, ["gateway", "scheduler", "rld-0"], ["scheduler", *INSTANCES]),
    *[(report(i), [i], ["scheduler"]) for i in INSTANCES for report in REPORTS],
    (subjects.inspect("md-0"), ["operator"], ["md-0"]),
    (subjects.flush_cache("prefill-0"), ["operator"], ["prefill-0"]),
    (subjects.wan_control("wan"), ["gateway", "operator"], ["wanlink"]),
]
USERS = ["gateway", "scheduler", *INSTANCES, "wanlink", "operator"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[tuple[str, Secrets]]:
    """One site holding every kind of user: its NATS server's URL and the cluster's secrets."""
    run = tmp_path_factory.mktemp("perm")
    port = free_port()
    instances = [{"id": i, "role": i.split("-")[0], "dc": "A"} for i in INSTANCES]
    raw = {"instances": instances, "datacenters": {"A": {"nats_port": port, "leaf_port": free_port()}}}
    secrets = Secrets(make_secrets(config_from_dict(raw), run / "secrets"))
    cfg = config_from_dict(raw | {"secrets_dir": str(secrets.directory)})
    (run / "nats-A.conf").write_text(server_conf(cfg, cfg.datacenter("A"), secrets))
    server = EmbeddedServer.nats("nats-A", run / "nats-A.conf", port, run).start()
    yield f"nats://127.0.0.1:{port}", secrets
    server.close()


@pytest.fixture
async def buses(site):
    url, secrets = site
    buses = {user: await Bus.connect(url, f"{user}-perm", user, secrets) for user in USERS}
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
    "user, subject",
    [
        ("md-0", subjects.prefill_drop("prefill-0")),  # main-decode cannot tell a prefill to drop a request
        ("prefill-0", subjects.ABORT),  # a prefill ends nothing for everyone: its failure goes to the gateway
        ("md-0", subjects.prefill_warm("prefill-0")),  # only the gateway feeds prefill's cache
        ("md-0", subjects.heartbeat("rld-0")),  # an instance reports as itself only
    ],
)
async def test_a_user_may_not_send_what_another_sends(buses, user, subject):
    """The negative controls."""
    nc = buses[user].nc
    await nc.publish(subject, b"forged")
    await nc.flush()
    await until(lambda: nc.last_error is not None, timeout=10.0, what="the server's -ERR")
    assert "permissions violation" in str(nc.last_error).lower()


async def test_a_service_is_reachable_once_serve_returns(site):
    """`Bus.serve` returns once the server routes to the new subscription: a request from another
    client right after it is answered, never "no responders". A plain flush after subscribing did
    not promise that (nats-py's PING can overtake the SUB on a new connection), and a wanlink test
    on a fresh clone met "no responders" that way; 300 new services catch it with near certainty."""
    url, secrets = site
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
